"""The jinja2 environment chat templates are compiled and rendered in, and the bounds it holds every rendering to.

A chat template comes from a checkpoint's files, so it is untrusted code, run on every request of a served model. It
runs in jinja2's immutable sandbox (no attribute starting with `_`, no unsafe callables, no mutation of passed-in
lists and dicts), and on top of that:

- work: every rendering has a budget of steps (step_budget: MAX_TEMPLATE_STEPS, plus STEPS_PER_MESSAGE for each
  message). The template's code is metered when it is compiled: each block of statements (a loop body, a branch, a
  macro or call block) charges what its nodes weigh every time it runs, a loop's `if` filter every time it is
  tested, each filter and test call FILTER_STEPS, and the values an operation goes through or builds (strings by
  length, lists and dicts by items) their size. Calls whose work grows past that are charged for it before they
  run: a comparison with each item of a list (`x in l`, `l.count(x)`, `l == m`, `loop.changed`) by the size of
  what is compared, the lines `indent` indents, the characters `translate` looks up and `strip` looks for, the
  strings `pprint` cuts up (and the repr it makes again at each depth, and each line it writes), a list's text
  that `title` or `urlize` go through, integers' digits (made text, parsed, divided: quadratic in their number),
  the characters a substring search compares (up to the needle's length at each position), the replacements
  `replace` makes, the arguments a call is given past a few (`f(*l)`), and each iteration of a loop run with a
  LoopContext (one whose body uses `loop`). A template that loops, recurses or grinds on large values without end
  is stopped at the budget, with a DFlashError naming `chat_template`, whatever it writes (or not): what it writes
  is charged too, out or into a captured block.
- size: no operation builds a string or list longer than MAX_RENDERED_CHARS, nor an integer wider than MAX_INT_BITS
  (`'x' * 10**9`, `s ~ s` doubled in a loop, `9 ** 9 ** 9` would fill memory or take hours in one step), nor a
  formatted field wider (`'{0:{1}}'.format(1, '99999999999')`); the filters and methods whose result can be much
  larger than what they are given (`indent` at every kind of line break, `tojson` escaping a string's characters
  in up to 12 and indented to each depth, `join` of integers, `format` of a list's text, `translate` by a list) are
  refused before they build it, and so is the text of a list, dict or namespace (its items' repr, escaped) or a
  string's repr, wherever it is made (`~`, written out, a filter: `_check_text`; `pprint`; a formatting:
  `_arg_text`); what `pprint` writes (each line of a dict's value indented by its key) is refused as it writes it;
  tokenization.TextCodec.render_chat also stops a rendering that writes more than MAX_RENDERED_CHARS.
- memory: the values a rendering's operations build (the strings, lists and the strings in them that filters,
  methods and operators return) count toward MAX_BUILT_BYTES in all, so values kept in variables cannot add up to
  gigabytes within the work budget (`s.split()` of a 16-million-character string builds 300 MB in one call); the
  pieces a split (`split`, `splitlines`, the words `title` or `striptags` cut a string into) may make are counted
  against what is left before they are made, and so is what the filters and methods whose result can be several
  times what they are given (case mappings, escaping, tojson, pprint, urlencode) may build at most. Strings are
  never made bytes (`str.encode` is refused): bytes are no text, and the sizes above are not checked on them.

The budget lives on the rendering's own jinja2 context (its EvalContext), so renderings on several threads of the one
shared environment never share a count. The metering nodes and filters have names a template cannot spell (they
contain spaces), so a template can neither call nor replace them.
"""

from __future__ import annotations

import functools
import io
import itertools
import operator
import re
import string
import sys
from collections.abc import ItemsView, KeysView, Mapping, Set, ValuesView

from dflash_export.decoding.request import is_int
from dflash_export.errors import DFlashError

MAX_RENDERED_CHARS = 16 << 20  # a rendered chat: 16 Mi characters, past any prompt of a 2**20-token context
# What a rendering may write in all, out and into `{% set x %}` / macro / call blocks it captures and may throw away:
# the work budget alone would let captured text reach a gigabyte (2**22 steps of 256 characters) before it stops.
MAX_WRITTEN_CHARS = 4 * MAX_RENDERED_CHARS

# The work budget. A step is at most about half a microsecond of work (loops, macro calls, filters and string work,
# measured alike), so MAX_TEMPLATE_STEPS stops a hostile template within a second or two. Real chat templates spend
# a fixed amount (a system prompt, a tool list: thousands of steps) plus, per message, a few small blocks (a role
# branch, the content, a tool call): SmolLM2's template 15 steps, a Qwen3-style one with reasoning and tool calls
# about 100 (content is charged by length, so a long message costs more: 140 at 4000 characters). Each message gets
# STEPS_PER_MESSAGE more, several times that, so a chat renders whatever its number of messages (a 2**20-token
# context holds up to some 200000 short ones); the text of a 2**20-token prompt, gone through a few times, is tens
# of thousands of steps of the fixed amount.
MAX_TEMPLATE_STEPS = 1 << 22
STEPS_PER_MESSAGE = 512
UNITS_PER_STEP = 8  # a block of statements charges its nodes' weights (_weight), 8 units to a step
CHARS_PER_STEP = 256  # string work (search, copy, compare) charges one step per 256 characters gone through
ITEMS_PER_STEP = 16  # list / dict work done in C (copy, compare, `in`) charges one step per 16 items
FILTER_STEPS = 2  # each call of a filter or test, the template's own or one made by `map` / `select`
FILTER_ITEM_STEPS = 4  # each item a filter goes through (sorting or selecting by an attribute: about 2 us an item)
MAX_INT_BITS = 1 << 16  # an integer of 65536 bits (about 20000 digits): past any count or id a template needs
# What a rendering's operations may build in all, in bytes as Python holds them: what the fixed work budget lets a
# template build of ASCII text (MAX_TEMPLATE_STEPS * CHARS_PER_STEP), past any real template's (a few copies of the
# prompt's text), whatever the number of messages.
MAX_BUILT_BYTES = 1 << 30
# The arguments of a call past a few (`f(*l)` passes a list's items on, and each is looked at): 2 to a step. (jinja2
# gives every call in a loop or block two of its own.)
ARGS_PER_STEP = 2
FEW_ARGS = 8
FIELD_STEPS = 4  # each field of a `str.format` / `%` formatting (the sandbox formats them one by one in Python)

_CHARGE = "chat template charge"  # charges its argument in steps, returns its value unchanged
_TOUCH = "chat template touch"  # charges the size of its value, returns it unchanged
_CONCAT = "chat template concat"  # the `~` operator, bounded
_COMPARE = "chat template compare"  # a comparison (`==`, `<`, `in`...), charged by what it goes through
_WRITE = "chat template write"  # charges writing its value out (as text), returns it unchanged
_WORK_ATTR = "chat_template_work"

# Filters that take O(1) time whatever the size of the list or dict they are given: charged nothing for its size
# (`messages|length` inside a loop over messages must stay linear).
_CONSTANT_TIME_FILTERS = frozenset(["attr", "count", "d", "default", "first", "items", "last", "length", "random"])
_COMPARING_TESTS = frozenset(["in", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt",
                              "greaterthan", ">", "ge", ">=", "sameas"])
_SIZE_CHECKED_FILTERS = frozenset(["format", "indent", "int", "join", "pprint", "replace", "slice", "sum", "tojson",
                                   "trim", "wordwrap"])
# Filters that go through a string given to them at C speed (a copy, a search): charged by its length
# (CHARS_PER_STEP). Those going through it with regular expressions or word by word are slower: charged a step for
# the characters they go through in about half a microsecond (measured on one-letter words, their worst case). Any
# other filter given a string goes through it character by character in Python (`sort`, `groupby`, `unique`,
# `batch`, `urlize`, `wordwrap`...) or makes each one an item (`list`): FILTER_ITEM_STEPS a character.
_TEXT_FILTERS = frozenset(["capitalize", "center", "e", "escape", "float", "forceescape", "format", "int", "lower",
                           "replace", "reverse", "safe", "string", "tojson", "trim", "truncate", "upper"]) \
    | _CONSTANT_TIME_FILTERS
# characters to a step (`indent`: counting its lines, splitting and joining them)
_SLOW_TEXT_FILTERS = {"indent": 32, "striptags": 4, "title": 2, "urlencode": 8, "wordcount": 8}
# Filters that make any value given to them text first, then go through that text character by character: a list or
# dict is made text before they are called, and charged as that text.
_TEXT_OF_ANY_VALUE = frozenset(["striptags", "title", "urlize", "wordcount"])
# Filters that make a value given to them text (`str()`, in the filter or in the check of its result's size): a list's
# or dict's text is bounded (`_check_text`) before it is made.
_MAKES_TEXT = _TEXT_OF_ANY_VALUE | {"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
                                    "replace", "safe", "string", "trim", "upper", "wordwrap"}
# Filters and string methods whose integer arguments are widths or counts of what they build (`center(10**9)` is a
# gigabyte of spaces): refused past MAX_RENDERED_CHARS, charged by size below it.
_WIDTH_FILTERS = frozenset(["batch", "center", "format", "indent", "slice", "tojson", "truncate", "wordwrap"])
_WIDTH_METHODS = frozenset(["center", "expandtabs", "ljust", "rjust", "zfill"])
_BLOCK_FIELDS = ("body", "else_")
# String methods and filters mapping case: CPython writes up to 3 characters for one ('\ufb03'.upper() is 'FFI')
# into a buffer of 4 bytes a character, then copies them into the result.
_CASE_MAPPINGS = frozenset(["capitalize", "casefold", "lower", "swapcase", "title", "upper"])
# Filters and string methods whose result can be several times larger than what they are given: _expansion_bytes
# (tojson and pprint: _check_filter, by the text they write).
_EXPANDING = _CASE_MAPPINGS | {"e", "escape", "forceescape", "urlencode"}
# What a loop whose body uses `loop` (or a recursive one) spends on each iteration past a plain one's, in units: its
# LoopContext, in Python, looks one item ahead and keeps the index (about 2 us an iteration).
_LOOP_CONTEXT_UNITS = 32
# String methods looking for a substring (their first argument) in the string: charged by _search_steps. Those
# starting with `r` search from the end.
_SEARCHING = frozenset(["count", "find", "index", "partition", "replace", "rfind", "rindex", "rpartition", "rsplit",
                        "split"])


def step_budget(messages) -> int:
    """The steps a rendering for `messages` may spend."""
    return MAX_TEMPLATE_STEPS + STEPS_PER_MESSAGE * (len(messages) if isinstance(messages, (list, tuple)) else 0)


class _Work:
    """One rendering's budget, the steps it has spent and the characters it has written, out or into captured blocks
    (mutable, so an `{% autoescape %}` block's save / restore of its EvalContext keeps the same count)."""

    __slots__ = ("steps", "limit", "written", "built")

    def __init__(self, limit: int):
        self.steps, self.limit, self.written, self.built = 0, limit, 0, 0


def _work(context) -> _Work:
    eval_ctx = context.eval_ctx
    work = getattr(eval_ctx, _WORK_ATTR, None)
    if work is None:  # a context made outside ChatTemplate.new_context
        work = _Work(MAX_TEMPLATE_STEPS)
        setattr(eval_ctx, _WORK_ATTR, work)
    return work


def _charge(context, steps: int) -> None:
    work = _work(context)
    work.steps += steps
    if work.steps > work.limit:
        raise DFlashError(f"the chat template did more than {work.limit} steps of work for these messages (loop "
                          "iterations, calls and the values they go through)", field="chat_template")


def _remaining(context) -> int:
    work = _work(context)
    return work.limit + 1 - work.steps


def _size(value) -> int:
    """Steps for C-speed work over `value` (a copy, a search, a comparison): strings by characters, lists, tuples,
    dicts and sets by items."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_STEP
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return len(value) // ITEMS_PER_STEP
    return 0


def _deep(value, limit: int, chars_per_step: int = CHARS_PER_STEP) -> int:
    """Steps for going through `value` item by item (writing it out as text, say): one per item of every nested list,
    tuple, dict (and its keys) or set, strings by characters (`chars_per_step` to a step), integers by what making
    them text takes (_int_steps). Counted up to `limit` and no further."""
    if isinstance(value, str):
        return 1 + len(value) // chars_per_step
    return _walk(value, limit, chars_per_step)[0]


def _walk(value, limit: int, chars_per_step: int = CHARS_PER_STEP, as_text: bool = False,
          json: bool = False) -> tuple[int, int, int]:
    """`_deep`'s steps for `value`, how deep its lists, tuples, dicts (keys and values), sets, dict views and
    namespaces nest (0: none), and the characters its text holds (strings' and integers' digits; 8 for any other
    item). `as_text`: the characters are an upper bound of the text `str(value)` makes of a list, dict or namespace
    (each item's repr: strings quoted and escaped, `_repr_chars`; any other object's its type and address); `json`:
    of the text tojson makes of it (strings as it escapes them, `_json_chars`; numbers, booleans and none as their
    repr: `inf` is `Infinity`, within the 8 an item has for its quotes and separators). Either is counted up to past
    MAX_RENDERED_CHARS and no further."""
    from jinja2 import Undefined
    from jinja2.utils import Namespace

    as_text = as_text or json
    steps, depth, chars, pending = 0, 0, 0, [iter((value,))]
    while pending and steps <= limit and not (as_text and chars > MAX_RENDERED_CHARS):
        item = next(pending[-1], _END)
        if item is _END:
            pending.pop()
            continue
        chars += 8
        if isinstance(item, str):
            steps += 1 + len(item) // chars_per_step
            chars += _json_chars(item) if json else _repr_chars(item) if as_text else len(item)
        elif isinstance(item, dict):
            steps += 1
            pending.append(itertools.chain(item.keys(), item.values()))
        elif isinstance(item, (list, tuple, set, frozenset)):
            steps += 1
            pending.append(iter(item))
        elif isinstance(item, (KeysView, ValuesView, ItemsView, Namespace)):  # `dict_items([...])`, `<Namespace {...}>`
            steps += 1
            chars += 16
            pending.append(iter(item) if not isinstance(item, Namespace) else
                           iter((object.__getattribute__(item, "_Namespace__attrs"),)))
        elif isinstance(item, range):
            steps += 1 + len(item)
            chars += 8 * len(item)
        elif is_int(item):
            steps += 1 + _int_steps(item)
            chars += _int_chars(item)
        else:
            steps += 1
            if as_text:
                chars += len(repr(item)) if type(item) in _SCALARS or isinstance(item, Undefined) else _OBJECT_CHARS
        depth = max(depth, len(pending) - 1)
    return steps, depth, chars


# What the text of an object other than a string, number, list, dict or namespace takes at most (its type and address:
# `<jinja2.utils.Cycler object at 0x7f...>`, `<bound method LoopContext.cycle of <LoopContext 1/3>>`).
_OBJECT_CHARS = 128
# repr() of a string that is not printable writes a character in up to 4 characters (`\x01`), 6 (`\u0378`) or 10
# (`\U000e0000`), by the widest character of the string (_char_bytes).
_ESCAPED_CHARS = {1: 4, 2: 6, 4: 10}


def _repr_chars(s: str) -> int:
    """An upper bound of the characters of `repr(s)` (how a list's or dict's text writes a string in it): its quotes
    (a Markup's name too), then each character as is, a backslash or quote in 2, or, if `s` is not printable, any
    character in up to _ESCAPED_CHARS."""
    quotes = 2 + (len(type(s).__name__) + 2 if type(s) is not str else 0)
    if s.isprintable():
        return quotes + len(s) + s.count("\\") + s.count("'")
    return quotes + len(s) * _ESCAPED_CHARS[_char_bytes(s)]


# tojson makes its JSON safe to put in HTML: each of these characters, as JSON writes it, is then written in 6
# (`\u003c`), 5 more.
_HTML_UNSAFE = "<>&'"
_JSON_PIECE = 1 << 20


def _html_escapes(s: str) -> int:
    """The characters tojson's HTML escaping adds to `s` (written out as is: an indent)."""
    return 5 * sum(str.count(s, c) for c in _HTML_UNSAFE)


def _json_chars(s: str) -> int:
    """The characters of `s` as tojson writes it: quoted, each character as JSON escapes it in ASCII (a quote or
    backslash in 2, a control character in 2 or 6, any past ASCII in 6, in 12 past the BMP: a surrogate pair), then
    `<>&'` in 6 more (`_html_escapes`). Exact: JSON's escaping measured a piece of _JSON_PIECE characters at a time
    (each built at most 12 times its size to know)."""
    from json.encoder import encode_basestring_ascii

    n = 2 + _html_escapes(s)
    for start in range(0, len(s), _JSON_PIECE):
        n += len(encode_basestring_ascii(s[start:start + _JSON_PIECE])) - 2
    return n


def _int_steps(n: int) -> int:
    """Steps for making `n` text, or parsing it from text (both take time quadratic in its digits: 220 us for 4300
    digits), or dividing by it."""
    return (n.bit_length() // 640) ** 2


def _int_chars(n: int) -> int:
    """An upper estimate of the digits of `n` written out, and its sign (log10(2) is 0.30103)."""
    return n.bit_length() * 31 // 100 + 2


def _compare_steps(value, limit: int) -> int:
    """Steps for comparing `value` with one other value, past a call's own: a string's characters, a list's or dict's
    items and what is in them (`_deep`); nothing for a number or a short string."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_STEP
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return _deep(value, limit)
    return 0


def _pair_steps(op: str, left, right, limit: int) -> int:
    """Steps for `left <op> right` (jinja2's names: eq, ne, lt, gt, lteq, gteq, in, notin): a comparison goes through
    the smaller side at most; `in` a list or tuple compares with each of its items."""
    if op in ("in", "notin"):
        if isinstance(right, str):
            return _search_steps(len(right), len(left)) if isinstance(left, str) else 0
        if not hasattr(right, "__len__"):
            return 0
        each = _compare_steps(left, limit)
        return each if isinstance(right, (Mapping, Set)) else each * len(right)  # hashed, or item by item
    first = _compare_steps(left, limit)
    return min(first, _compare_steps(right, first))


def _search_steps(n: int, m: int, reverse: bool = False) -> int:
    """Steps for looking for a substring of `m` characters in a string of `n` (`in`, find, count, split, replace...),
    past a copy's charge: CPython compares up to `m` characters at each position (searching from the end, for a
    needle shorter than 6 characters, or in a short string: `'x' * 999 + 'yx'` looked for in 30000 `x` compares 30
    million characters), or about 2 (its linear two-way search, for a longer needle in a longer string)."""
    if m < 2 or m > n:
        return 0  # one character: memchr, at a copy's speed
    linear = not reverse and m >= 6 and n >= (2500 if m >= 100 else 30000)
    return (n - m + 1) * (2 if linear else m) // CHARS_PER_STEP


_END = object()


def _refuse_len(n: int, what: str) -> None:
    if n > MAX_RENDERED_CHARS:
        raise _security_error(f"{what} of {n} items (more than {MAX_RENDERED_CHARS})")


def _security_error(message: str):
    from jinja2.sandbox import SecurityError

    return SecurityError(message)


def _check_result(value) -> None:
    if isinstance(value, (str, list, tuple)):
        _refuse_len(len(value), "a string or list")


def _bytes(value, items: bool) -> int:
    """The memory `value` holds as an operation's result: a string's, a list's or tuple's, and with `items`
    _ITEM_BYTES more for each item in it (without going through them)."""
    if not isinstance(value, (str, list, tuple, dict)):
        return 0
    return sys.getsizeof(value) + (_ITEM_BYTES * len(value) if items and isinstance(value, (list, tuple)) else 0)


_NON_ASCII_HEADER = sys.getsizeof("\u0100") - 4  # a non-ASCII string's size less its characters and terminator


def _char_bytes(s: str) -> int:
    """The bytes a character of `s` takes as Python holds it: 1 (ASCII or Latin-1 text), 2 or 4."""
    if s.isascii():
        return 1
    return min(4, max(1, (sys.getsizeof(s) - _NON_ASCII_HEADER) // (len(s) + 1)))  # a Markup: a longer header


def _expansion_bytes(name: str, value) -> int:
    """An upper bound of the memory the filter or string method `name` builds from `value` (its result and what
    CPython builds on the way to it), for those whose result can be several times larger than `value`, counted
    before they run: a case mapping (_CASE_MAPPINGS) writes up to 3 characters for one of non-ASCII text, into a
    buffer of 4 bytes a character then into the result; escaping up to 5 ('"' is '&#34;'), then copied into a
    Markup; urlencode 3 for each byte of the text's UTF-8, with a list of 8-byte slots, one a byte, first. 0 for any
    other."""
    if not isinstance(value, str):
        return 0
    n, width = len(value), _char_bytes(value)
    if name in _CASE_MAPPINGS:
        return n if value.isascii() else 3 * n * (4 + max(2, width))
    if name in ("e", "escape", "forceescape"):
        return 2 * 5 * n * width
    if name == "urlencode":
        return 12 * n * (1 if value.isascii() else width + 1 - width // 4)  # UTF-8: up to 2, 3 or 4 bytes a char
    return 0


# What a new item of a list that a method or filter returns holds, its text aside (a method's pieces of a string
# count that string's size once): a short string's header and the list's pointer to it (a one-character piece of a
# non-Latin-1 string: 84 bytes), a small tuple or list (`s.split()`, `x|batch(2)`, `d|dictsort`).
_ITEM_BYTES = 88


def _built(context, value, items: bool = True, text: int = 0) -> None:
    """`value`, an operation's result: refused if longer than MAX_RENDERED_CHARS, and counted toward what the
    rendering builds in all (MAX_BUILT_BYTES), with `text` bytes of new strings in it. `items`: its items may be new
    (see `_bytes`); an operator's list holds only values that were there before (`l + [x]`, `[x] * n`)."""
    _check_result(value)
    work = _work(context)
    work.built += _bytes(value, items) + text
    if work.built > MAX_BUILT_BYTES:
        raise _security_error(f"more than {MAX_BUILT_BYTES} bytes of strings and lists built")


def _check_room(context, nbytes: int) -> None:
    """Refuse what would take the bytes the rendering has built, and `nbytes` more, past MAX_BUILT_BYTES."""
    if _work(context).built + nbytes > MAX_BUILT_BYTES:
        raise _security_error(f"more than {MAX_BUILT_BYTES} bytes of strings and lists built")  # as _built says


# Making a list's text goes through its strings twice (is each printable, and its quotes and backslashes: about 6 ns
# a character), then writes their repr: 64 characters to a step.
TEXT_CHARS_PER_STEP = 64
# The bytes a text of n characters may take while CPython writes it: 4 a character, and a quarter more for the buffer
# it grows as it goes.
_TEXT_BYTES = 5


def _check_text(context, value) -> int:
    """Before `value` (a list, tuple, dict, set, namespace or any other value but a string) is made text (`~`, written
    out, a filter that takes text): charge going through it, and refuse it if its text (an upper bound: `_walk`
    as_text) could pass MAX_RENDERED_CHARS or what is left of MAX_BUILT_BYTES. Returns that bound."""
    steps, _, chars = _walk(value, _remaining(context), TEXT_CHARS_PER_STEP, as_text=True)
    _charge(context, steps)
    _refuse_len(chars, "the text of a value")
    _check_room(context, _TEXT_BYTES * chars)
    return chars


def _arithmetic_steps(operator: str, left, right) -> int:
    """Steps for arithmetic on integers wider than a machine word: multiplying, dividing or raising to a power takes
    time that grows with the product of the operands' widths (a power: its result's, with itself), about 1.6 ms to
    divide a 65536-bit integer by a 32768-bit one."""
    if not (is_int(left) and is_int(right)):
        return 0
    a, b = left.bit_length(), right.bit_length()
    if operator == "**":
        a = b = max(0, right) * a if abs(left) > 1 else 0
    return (a >> 9) * (b >> 9) // 2 + (a + b) // 1024


def _check_int(n, what: str = "an argument") -> None:
    if is_int(n) and abs(n) > MAX_RENDERED_CHARS:
        raise _security_error(f"{what} of {n} (more than {MAX_RENDERED_CHARS})")


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*|\*)(?:\.(\d*|\*))?[hlL]?[diouxXeEfFgGcrsa%]")


def _arg_text(context, values, conversions: str = "") -> tuple[int, int]:
    """The steps formatting the costliest of `values` takes once (a list or dict is gone through, and charged, to
    know; an integer's digits take time quadratic in their number), and an upper estimate of the characters the
    widest writes. `conversions`: those the format asks for (a string's repr, `r`, is quoted and escaped; `ascii()`,
    `a`, escapes every character past ASCII too, in up to 10)."""
    steps, widest = 0, 0
    for value in values:
        if isinstance(value, str):
            cost, chars = len(value) // CHARS_PER_STEP, _repr_chars(value) if "r" in conversions else len(value)
        elif is_int(value):
            cost, chars = _int_steps(value), _int_chars(value)
        else:  # a list's, dict's or namespace's text: its items' (an upper bound)
            cost, _, chars = _walk(value, _remaining(context), as_text=True)
            _charge(context, cost)
        if "a" in conversions:
            chars *= _ESCAPED_CHARS[4]
        steps, widest = max(steps, cost), max(widest, chars)
    return steps, widest


def _check_printf(context, fmt: str, values) -> None:
    """Refuse a printf-style formatting (`fmt % values`, `fmt|format(...)`) whose result could pass
    MAX_RENDERED_CHARS: each conversion writes at most its width, precision (either given, or `*`: taken from the
    values, the largest integer among them) and the longest value. Charges FIELD_STEPS a conversion, and formatting
    the costliest value for each."""
    if isinstance(values, dict):
        args = list(values.values())
    elif isinstance(values, tuple):
        args = list(values)
    else:
        args = [values]
    for a in args:
        _check_int(a)
    _charge(context, FIELD_STEPS * fmt.count("%"))  # before the conversions are looked at one by one
    each, widest = _arg_text(context, args, "".join(m.group(0)[-1] for m in _PRINTF.finditer(fmt)))
    _charge(context, each * fmt.count("%"))
    star = max((abs(a) for a in args if is_int(a)), default=0)
    total = len(fmt)
    for m in _PRINTF.finditer(fmt):
        total += widest + sum(star if g == "*" else int(g) for g in m.groups() if g)
    _refuse_len(total, "a formatted string")


def _check_str_format(context, fmt: str, args, kwargs) -> None:
    """The same bound for `fmt.format(...)` / `fmt.format_map(...)`, estimated from the format string as written
    (a width given by a nested field, `{0:{1}}`, is bounded as it is formatted: `_BoundedFields`). Charges FIELD_STEPS
    a field, and formatting the costliest value for each."""
    values = list(args) + list(kwargs.values())
    if len(values) == 1 and isinstance(values[0], dict):
        values += list(values[0].values())
    for a in values:
        _check_int(a)
    _charge(context, FIELD_STEPS * fmt.count("{"))  # before the fields are looked at one by one
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format refuses it too
    each, widest = _arg_text(context, values, "".join(conversion or "" for *_, conversion in fields))
    _charge(context, each * fmt.count("{"))
    total = len(fmt)
    for _, field, spec, _ in fields:
        if field is not None:
            total += widest + sum(int(d) for d in re.findall(r"\d+", spec or ""))
    _refuse_len(total, "a formatted string")


def _check_replace(context, s: str, old: str, new: str, count) -> None:
    """Refuse `s.replace(old, new, count)` if its result would pass MAX_RENDERED_CHARS, and charge its replacements
    (each found and copied in turn: about 8 ns one) and its searches past the one `_method_steps` charges (the
    replacements counted here, and by CPython before it replaces)."""
    _charge(context, 2 * _search_steps(len(s), len(old)))
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    _charge(context, n // ITEMS_PER_STEP)
    _refuse_len(len(s) + n * (len(new) - len(old)), "a string")


def _joined_len(sep: str, items: list) -> int:
    return sum(len(x) for x in items if isinstance(x, str)) + len(sep) * max(0, len(items) - 1)


def _check_str_method(context, name: str, s: str, args, kwargs) -> list:
    """Refuse a call of a string method that would build a string past MAX_RENDERED_CHARS; returns the arguments to
    call it with (an iterable given to `join` is made a list, once, to be measured)."""
    args = list(args)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(context, s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"))
    elif name == "join" and len(args) == 1:
        if not isinstance(args[0], (list, tuple)):
            args[0] = list(args[0])
        _refuse_len(_joined_len(s, args[0]), "a string")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _refuse_len(len(s) + s.count("\t") * max(0, size), "a string")
    elif name == "translate" and len(args) == 1 and isinstance(args[0], (dict, list, tuple)):
        table = args[0].values() if isinstance(args[0], dict) else args[0]
        longest = max((len(v) for v in table if isinstance(v, str)), default=1)
        _refuse_len(len(s) * max(1, longest), "a string")
    return args


_SPLITTING = frozenset(["split", "rsplit", "splitlines"])


def _method_steps(context, target, name: str, given: tuple) -> int:
    """Steps a method call (given `given`, its arguments) takes past the sizes of its object and arguments: stripping
    characters that are each looked for among those given, a string's prefixes (`startswith` a tuple), looking each
    character up (`translate`: about 26 ns one), comparing a value with each item of a list (`count`, `index`,
    `loop.changed`), looking for a substring (_search_steps), and `str.maketrans` (about 90 ns a character)."""
    if isinstance(target, str):
        if name in _SEARCHING:
            needle = given[0] if given else None
            return _search_steps(len(target), len(needle), name.startswith("r")) if isinstance(needle, str) else 0
        if name in ("strip", "lstrip", "rstrip"):
            return len(target) * (len(given[0]) - 1) // CHARS_PER_STEP if given and isinstance(given[0], str) else 0
        if name in ("startswith", "endswith"):
            return _deep(given[0], _remaining(context)) if given and isinstance(given[0], tuple) else 0
        return len(target) // 8 if name == "translate" else 0
    if name in ("count", "index") and isinstance(target, (list, tuple)) and given:
        return len(target) * _compare_steps(given[0], _remaining(context))
    if name == "changed":
        from jinja2.runtime import LoopContext

        return _compare_steps(given, _remaining(context)) if isinstance(target, LoopContext) else 0
    if name == "maketrans" and target is None:  # `''.maketrans`: a static method, bound to nothing
        return sum(len(a) // 2 if isinstance(a, str) else _deep(a, _remaining(context)) for a in given)
    return 0


def _pieces_bytes(s: str, name: str, args, kwargs) -> int:
    """An upper bound of the memory `s.split(...)` / `rsplit` / `splitlines` builds: a list of pieces holding the
    string's text once more (counted before the pieces are made: `' '.join(...).split()` makes millions of them)."""
    sep = args[0] if args else kwargs.get("sep")
    maxsplit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
    counted = isinstance(sep, str) and sep
    pieces = len(s) + 1 if name == "splitlines" else len(s) // (len(sep) if counted else 2) + 1
    if pieces > 4096:  # counted only where it could matter
        pieces = _lines(s) if name == "splitlines" else s.count(sep) + 1 if counted else pieces
    if is_int(maxsplit) and maxsplit >= 0:
        pieces = min(pieces, maxsplit + 1)
    return sys.getsizeof(s) + sys.getsizeof([]) + (8 + _ITEM_BYTES) * pieces


_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines splits


def _lines(s) -> int:
    """The lines of `s`'s text as str.splitlines (and so `indent`, `wordwrap`) splits it, at most."""
    s = str(s)
    return 1 + sum(s.count(c) for c in _LINE_BREAKS)


def _check_filter(context, name: str, args: list, kwargs: dict) -> None:
    """The filters whose result (or time) can be much larger than what they are given, bounded before they run."""
    value = args[0] if args else None
    params = args[1:]

    def param(i, key, default=None):
        return params[i] if len(params) > i else kwargs.get(key, default)

    if name == "replace" and isinstance(param(0, "old"), str) and isinstance(param(1, "new"), str):
        text = str(value)  # what the filter replaces in (a list's text bounded already: _check_text)
        _charge(context, _search_steps(len(text), len(param(0, "old"))))  # the filter's own search
        _check_replace(context, text, param(0, "old"), param(1, "new"), param(2, "count"))
    elif name == "join" and isinstance(value, (list, tuple)):
        # Items are made text (an integer's digits, a list's items) or taken by attribute: the text of all of it.
        sep = param(0, "d", "")
        total = (len(sep) if isinstance(sep, str) else _check_text(context, sep)) * len(value)
        for item in value:
            total += len(item) if isinstance(item, str) else _walk(item, _remaining(context), as_text=True)[2]
            _refuse_len(total, "a string")
    elif name == "indent":
        width = param(0, "width", 4)
        wide = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        lines = _lines(value)
        _charge(context, lines // 4)  # each line is indented in Python: about 50 ns a line
        _refuse_len(len(str(value)) + wide * lines, "a string")
    elif name == "wordwrap":
        width, wrap = param(0, "width", 79), param(2, "wrapstring")
        if isinstance(width, int) and width > 0 and isinstance(wrap, str):
            _refuse_len(len(str(value)) * (1 + len(wrap)) // width + len(str(value)) + _lines(value) * len(wrap),
                        "a string")
    elif name == "format":
        from markupsafe import soft_str

        _check_printf(context, soft_str(value), kwargs if kwargs else tuple(params))  # any value's text formats
    elif name == "tojson":
        # Its JSON (strings escaped as it escapes them, up to 12 characters for one), and with an indent each item
        # on a line of its own, indented to its depth: the size grows with depth times items.
        indent = param(0, "indent")
        items, depth, size = _walk(value, _remaining(context), json=True)
        if isinstance(indent, (int, str)):
            size += 2 * items * depth * max(1, len(indent) + _html_escapes(indent) if isinstance(indent, str)
                                            else indent)
        _charge(context, size // CHARS_PER_STEP)
        _refuse_len(size, "a string")
        # The text, its copy into a Markup, and the pieces it is written in (an indented one: a few an item).
        _check_room(context, 2 * size + (8 + _ITEM_BYTES) * items)
    elif name == "pprint":
        # The value's repr (a string's escaped: up to 10 characters for one), long strings cut into lines of about
        # 70 characters, each line indented to its depth (how much a dict's key adds is bounded as it is written:
        # _pformat). Before it writes, pformat makes the repr of what is below each depth again (the time grows with
        # the square of the depth), and holds it (up to 4 bytes a character).
        items, depth, chars = _walk(value, _remaining(context), as_text=True)
        _refuse_len(chars + (items + chars // 40) * depth, "a string")
        _charge(context, depth * (depth + 1) // 2 * chars // CHARS_PER_STEP)
        _check_room(context, (_PPRINT_BYTES + 4 * depth) * chars)
    elif name == "trim" and isinstance(param(0, "chars"), str):
        _charge(context, len(str(value)) * len(param(0, "chars")) // CHARS_PER_STEP)  # each character looked for
    elif name == "int" and isinstance(value, str):
        _charge(context, _int_steps(1 << (min(len(value), 5000) * 10 // 3)))  # digits past 4300 refused at once
    elif name == "slice" and isinstance(param(0, "slices"), int):
        _charge(context, max(0, param(0, "slices")))
    elif name == "sum" and not isinstance(param(1, "start", 0), (int, float)) and isinstance(value, (list, tuple)):
        # Adding lists one after another copies the sum so far every time.
        total, copied = 0, 0
        for item in value:
            total += len(item) if isinstance(item, (list, tuple, str)) else 1
            copied += total
            if copied // ITEMS_PER_STEP > _remaining(context):
                break
        _charge(context, copied // ITEMS_PER_STEP)
        _refuse_len(total, "a list")


# What pprint builds for a character of the value's repr, at most, past the reprs it holds at each depth: the repr,
# a long string's lines and words (a new string for each, up to one for two characters: about 50 bytes a character)
# and the repr of each, the text as written and its copy (up to 4 bytes a character each). Measured: up to 64.
_PPRINT_BYTES = 80


class _PformatStream(io.StringIO):
    """What the `pprint` filter writes into: each write charged (a step, and its characters), the text refused once
    past MAX_RENDERED_CHARS, or once it and its copy (up to 4 bytes a character each) would pass what is left of
    MAX_BUILT_BYTES."""

    def __init__(self, context):
        super().__init__()
        self.context, self.written = context, 0

    def write(self, s):
        self.written += len(s)
        _charge(self.context, 1 + len(s) // CHARS_PER_STEP)
        _refuse_len(self.written, "a string")
        _check_room(self.context, 8 * self.written)
        return super().write(s)


def _pformat(context, value):
    """jinja2's `pprint` filter (`pprint.pformat(value)`), written into a _PformatStream: how long its text gets is
    known only as it is written (each line of a dict's value is indented by its key's repr, however long)."""
    import pprint

    stream = _PformatStream(context)
    pprint.PrettyPrinter(stream=stream).pprint(value)
    return stream.getvalue()[:-1]  # less the line break pprint ends with (pformat writes none)


def _counted(context, iterable):
    """An iterator given to a filter, charging each item as the filter takes it."""
    for item in iterable:
        _charge(context, FILTER_ITEM_STEPS * _deep(item, _remaining(context)))
        yield item


def _metered_filter(name: str, func, is_test: bool = False):
    """`func` (a filter or test), charging each call and the values it is given before it runs, and bounding what it
    returns. Filters go through their value item by item (FILTER_ITEM_STEPS an item; an iterator, such as another
    filter's output, as the filter takes it); tests look at a value's type, comparisons and `in` go through theirs."""
    from jinja2.runtime import LoopContext
    from jinja2.utils import _PassArg, pass_context

    pass_arg = _PassArg.from_obj(func)
    goes_through = name in _COMPARING_TESTS if is_test else name not in _CONSTANT_TIME_FILTERS
    # The characters of a string value to a step (0: FILTER_ITEM_STEPS a character).
    chars_per_step = CHARS_PER_STEP if is_test or name in _TEXT_FILTERS else _SLOW_TEXT_FILTERS.get(name, 0)
    checked = not is_test and name in _SIZE_CHECKED_FILTERS
    text_first = not is_test and name in _TEXT_OF_ANY_VALUE
    makes_text = not is_test and name in _MAKES_TEXT
    # pprint writes each character of the strings in a list or dict in Python (about 170 ns one).
    container_chars = 1 if name == "pprint" else CHARS_PER_STEP
    widths = not is_test and name in _WIDTH_FILTERS
    expands = not is_test and name in _EXPANDING

    @pass_context
    @functools.wraps(func)
    def metered(context, *args, **kwargs):
        steps = FILTER_STEPS
        if args and goes_through:
            value = args[0]
            if makes_text and not isinstance(value, str):
                _check_text(context, value)
            if text_first and isinstance(value, (list, tuple, dict)):
                value = str(value)
                args = (value, *args[1:])
            if isinstance(value, str):
                steps += len(value) // chars_per_step if chars_per_step else FILTER_ITEM_STEPS * len(value)
                if text_first:  # cut into words, a list of them, before they are gone through
                    _check_room(context, _pieces_bytes(value, "split", (), {}))
            elif is_test:
                steps += _size(value)
            elif hasattr(value, "__next__") and not isinstance(value, LoopContext):
                args = (_counted(context, value), *args[1:])
            else:
                steps += FILTER_ITEM_STEPS * _deep(value, _remaining(context), container_chars)
            if expands:
                _check_room(context, _expansion_bytes(name, value))
        if is_test and name in _COMPARING_TESTS and name != "sameas" and len(args) > 1:
            steps += _pair_steps("in" if name == "in" else "eq", args[0], args[1], _remaining(context))
        if checked and name == "join" and hasattr(args[0], "__next__") and not isinstance(args[0], LoopContext):
            args = (list(args[0]), *args[1:])  # measured before it is joined
        if len(args) + len(kwargs) > FEW_ARGS:
            steps += (len(args) + len(kwargs)) // ARGS_PER_STEP
        for a in (*args[1:], *kwargs.values()):
            if widths and is_int(a):
                _check_int(a)
                steps += abs(a) // ITEMS_PER_STEP
            else:
                steps += _size(a)
        if checked:
            _check_filter(context, name, args, kwargs)
        _charge(context, steps)
        if pass_arg is _PassArg.context:
            result = func(context, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = func(context.eval_ctx, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = func(context.environment, *args, **kwargs)
        else:
            result = func(*args, **kwargs)
        _built(context, result)
        _charge(context, _size(result))
        return result

    return metered


def _charge_filter(context, value, steps):
    _charge(context, steps)
    return value


def _touch_filter(context, value):
    _charge(context, _size(value))
    return value


def _write_filter(context, value):
    """`value`, charged for being written out (made text first: `_check_text`)."""
    if isinstance(value, str):
        _charge(context, 1 + len(value) // CHARS_PER_STEP)
    chars = len(value) if isinstance(value, str) else _check_text(context, value)
    work = _work(context)
    work.written += chars
    if work.written > MAX_WRITTEN_CHARS:
        raise _security_error(f"more than {MAX_WRITTEN_CHARS} characters written, out or into captured blocks")
    return value


_OPERATORS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "gt": operator.gt, "lteq": operator.le,
              "gteq": operator.ge, "in": lambda a, b: a in b, "notin": lambda a, b: a not in b}


_SCALARS = frozenset([int, float, bool, type(None)])
_SEARCH_OPS = frozenset(["in", "notin"])


def _compare_filter(context, left, op, right, *rest):
    """`left op right` (`rest`: more operators and values, alternating), as Python chains comparisons (all its
    operands evaluated first), each comparison charged by the sizes of its operands and what it goes through
    (`_pair_steps`), unless both are numbers, short strings or none (most are: a role, a key, a count); a substring
    search (`in` a string) by what it compares, whatever the sizes."""
    t, u = type(left), type(right)
    small_left = t is str and len(left) < CHARS_PER_STEP or t in _SCALARS
    small_right = u is str and len(right) < CHARS_PER_STEP or u in _SCALARS
    if not (small_left and small_right):
        steps = _size(left) + _size(right)
        if not (small_left or small_right) or op in _SEARCH_OPS and isinstance(right, str):
            steps += _pair_steps(op, left, right, _remaining(context))  # with a small one, only the sizes count
        if steps:
            _charge(context, steps)
    elif op in _SEARCH_OPS and t is str and u is str:
        steps = _search_steps(len(right), len(left))
        if steps:
            _charge(context, steps)
    result = _OPERATORS[op](left, right)
    if rest and result:
        return _compare_filter(context, right, *rest)
    return result


def _concat_filter(context, items):
    """`a ~ b ~ c`: each value as text, joined, refused past MAX_RENDERED_CHARS before it is built."""
    from jinja2.runtime import markup_join, str_join

    total = 0
    for item in items:
        total += len(item) if isinstance(item, str) else _check_text(context, item)
        _refuse_len(total, "a string")  # before any value is made text
    parts = [item if isinstance(item, str) else str(item) for item in items]
    _charge(context, 2 * FILTER_STEPS + sum(len(p) for p in parts) // CHARS_PER_STEP)
    _refuse_len(sum(len(p) for p in parts), "a string")
    eval_ctx = context.eval_ctx
    result = (markup_join if eval_ctx.volatile or eval_ctx.autoescape else str_join)(parts)
    _built(context, result, items=False)
    return result


# --- metering the template's syntax tree -----------------------------------------------------------------------------

def _weight(node) -> int:
    """What `node` costs each time the block holding it runs, in units (about 50 ns each): a call (a macro, a method)
    80, an operator or a size charge 10 (a comparison: as an operator, with a size charge for each operand), any
    other node 1. Not counted: nested blocks (they charge for themselves), a loop's `if` filter (charged each time it
    is tested), a macro's or call block's defaults (charged by its body)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Call):
        units = 80
    elif isinstance(node, nodes.BinExpr) or (isinstance(node, nodes.Filter) and node.name == _TOUCH):
        units = 10
    elif isinstance(node, nodes.Filter) and node.name == _COMPARE:
        units = 1 + 10 * (1 + len(node.args) // 2)  # as an operator with a size charge for each operand
    else:
        units = 1  # a filter or test charges its calls itself (FILTER_STEPS)
    for field in node.fields:
        if field in _BLOCK_FIELDS or (isinstance(node, nodes.For) and field == "test") or \
                (isinstance(node, (nodes.Macro, nodes.CallBlock)) and field in ("defaults", "args")):
            continue
        value = getattr(node, field)
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, nodes.Node):
                units += _weight(child)
    return units


def _steps(units: int) -> int:
    """Steps a block of `units` charges each time it runs: rounded up, and 4 units for charging them."""
    return -(-(units + 4) // UNITS_PER_STEP)


def _charge_node(steps: int, value=None):
    from jinja2 import nodes

    return nodes.Filter(value if value is not None else nodes.Const(None), _CHARGE, [nodes.Const(steps)], [],
                        None, None)


def _meter(node) -> None:
    """Rewrite the tree under `node` in place: every block of statements starts by charging its own size, a loop's
    `if` filter charges its size each time it is tested, the operands of comparisons and slices charge their sizes,
    and `~` goes through the bounded concatenation."""
    from jinja2 import nodes

    # A slice a size charge wraps is charged by it already: only what is inside the slice is looked at.
    touched = isinstance(node, nodes.Filter) and node.name == _TOUCH
    for field in node.fields:
        value = getattr(node, field)
        if isinstance(value, list):
            for i, child in enumerate(value):
                if isinstance(child, nodes.Node):
                    value[i] = child if touched and _is_slice(child) else _metered_expr(child)
                    _meter(value[i])
        elif isinstance(value, nodes.Node):
            setattr(node, field, value if touched and _is_slice(value) else _metered_expr(value))
            _meter(getattr(node, field))
    if isinstance(node, nodes.Output):
        # What is written is made text first (a list's text takes as long as going through it), into the output or
        # into a captured block (`{% set x %}`), which no cap on the rendering's output sees.
        node.nodes = [child if isinstance(child, nodes.TemplateData) else
                      nodes.Filter(child, _WRITE, [], [], None, None, lineno=child.lineno) for child in node.nodes]
    if isinstance(node, nodes.For) and node.test is not None:
        node.test = _charge_node(_steps(_weight(node.test)), node.test)
    for field in _BLOCK_FIELDS:
        body = getattr(node, field, None) if field in node.fields else None
        if body is None or (field == "else_" and not body):
            continue
        extra = 0
        if isinstance(node, (nodes.Macro, nodes.CallBlock)):
            extra = sum(_weight(d) for d in node.defaults + node.args)
        if isinstance(node, nodes.For) and field == "body" and _extended_loop(node):
            extra = _LOOP_CONTEXT_UNITS
        units = sum(_weight(stmt) for stmt in body) + extra
        body.insert(0, nodes.ExprStmt(_charge_node(_steps(units))))


def _extended_loop(node) -> bool:
    """Whether jinja2 runs the loop `node` with a LoopContext (as its compiler decides: recursive, or its body uses
    `loop`)."""
    from jinja2.compiler import find_undeclared

    return node.recursive or "loop" in find_undeclared(node.iter_child_nodes(only=("body",)), ("loop",))


def _metered_expr(node):
    """`node`, or the node charging for it: comparisons charge their operands' sizes, slices their result's size,
    and `~` becomes the bounded concatenation."""
    from jinja2 import nodes

    if isinstance(node, nodes.Compare):
        rest = [child for op in node.ops for child in (nodes.Const(op.op), op.expr)]
        return nodes.Filter(node.expr, _COMPARE, rest, [], None, None, lineno=node.lineno)
    if _is_slice(node):
        return _touch(node)
    if isinstance(node, nodes.Concat):
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT, [], [], None, None,
                            lineno=node.lineno)
    return node


def _is_slice(node) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)


def _touch(node):
    from jinja2 import nodes

    return nodes.Filter(node, _TOUCH, [], [], None, None, lineno=node.lineno)


@functools.cache
def chat_environment():
    """The only jinja2 environment chat templates are compiled and rendered in (see the module's docstring). Made
    once per process and shared: nothing changes it after this function, and each rendering keeps its own count of
    work."""
    import types

    import jinja2.ext
    from jinja2.runtime import LoopContext, Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
    from jinja2.utils import pass_context
    from markupsafe import Markup

    class BoundedFields:
        """What `str.format` / `format_map` format with (mixed into jinja2's sandboxed formatters): each field's
        format spec, as resolved (nested fields filled in), asks for no width or precision past MAX_RENDERED_CHARS,
        and the fields formatted so far are refused once past it, before the next one is built."""

        def vformat(self, format_string, args, kwargs):
            self.formatted = 0
            return super().vformat(format_string, args, kwargs)

        def format_field(self, value, format_spec):
            _refuse_len(sum(int(d) for d in re.findall(r"\d+", format_spec)), "a format width")
            text = super().format_field(value, format_spec)
            self.formatted += len(text)
            _refuse_len(self.formatted, "a formatted string")
            return text

    class Formatter(BoundedFields, SandboxedFormatter):
        pass

    class EscapeFormatter(BoundedFields, SandboxedEscapeFormatter):
        pass

    class ChatTemplate(jinja2.Template):
        def new_context(self, vars=None, shared=False, locals=None):
            context = super().new_context(vars, shared, locals)
            setattr(context.eval_ctx, _WORK_ATTR, _Work(step_budget((vars or {}).get("messages"))))
            return context

    class ChatSandbox(ImmutableSandboxedEnvironment):
        # Every operator: the sandbox does not fold intercepted ones at compile time, so all of them run (and are
        # charged) in the rendering.
        intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
        template_class = ChatTemplate

        def is_safe_attribute(self, obj, attr, value):
            # `str.encode` makes bytes, which no chat template needs, which the bounds on strings do not see
            # (`'x'.encode() * 10**10`), and through codecs written in Python (punycode: quadratic).
            return not (isinstance(obj, str) and attr == "encode") and super().is_safe_attribute(obj, attr, value)

        def wrap_str_format(self, value):
            """jinja2's sandboxed `str.format` / `format_map`, formatting with BoundedFields."""
            if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                    value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
                return None
            fmt, is_map = value.__self__, value.__name__ == "format_map"
            formatter = EscapeFormatter(self, escape=fmt.escape) if isinstance(fmt, Markup) else Formatter(self)

            def wrapper(*args, **kwargs):
                if is_map:
                    if kwargs:
                        raise TypeError("format_map() takes no keyword arguments")
                    if len(args) != 1:
                        raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                    args, kwargs = (), args[0]
                return type(fmt)(formatter.vformat(fmt, args, kwargs))

            return functools.update_wrapper(wrapper, value)

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            _meter(tree)
            return tree

        def call_binop(self, context, operator, left, right):
            _charge(context, _size(left) + _size(right))
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        if len(seq) * n > MAX_RENDERED_CHARS:
                            raise _security_error(f"a repetition of {len(seq) * n} items "
                                                  f"(more than {MAX_RENDERED_CHARS})")
                        _charge(context, len(seq) * max(0, n) // (CHARS_PER_STEP if isinstance(seq, str)
                                                                   else ITEMS_PER_STEP))
                if is_int(left) and is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _security_error(f"a product of more than {MAX_INT_BITS} bits")
            elif operator == "**":
                if is_int(left) and is_int(right) and abs(left) > 1 and right * left.bit_length() > MAX_INT_BITS:
                    raise _security_error(f"a power of more than {MAX_INT_BITS} bits")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                    _refuse_len(len(left) + len(right), "a string or list")
            elif operator == "%" and isinstance(left, str):
                _check_printf(context, left, right)
            if isinstance(left, int) and isinstance(right, int) and (left.bit_length() | right.bit_length()) >> 9:
                _charge(context, _arithmetic_steps(operator, left, right))  # wide ones, their widths checked above
            result = super().call_binop(context, operator, left, right)
            _built(context, result, items=False)
            if is_int(result) and result.bit_length() > MAX_INT_BITS:  # `n + n` again and again
                raise _security_error(f"an integer of more than {MAX_INT_BITS} bits")
            return result

        def call(self, context, obj, /, *args, **kwargs):
            if len(args) + len(kwargs) > FEW_ARGS:  # `f(*l)`: each argument passed on, and looked at
                _charge(context, (len(args) + len(kwargs)) // ARGS_PER_STEP)
            if not isinstance(obj, (Macro, LoopContext)):
                # A function or method of the data (a string's `split`, `replace`...): charged by the sizes of
                # what it goes through, its arguments and result bounded. (`_loop_vars` / `_block_vars` are the
                # template's own variables, handed over by jinja2 with every call in a loop or block.)
                method = getattr(obj, "__wrapped__", obj)  # the sandbox's wrapper of str.format
                target, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
                given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
                values = (*args, *given.values())
                steps = _size(target) + sum(_size(a) for a in values)
                if isinstance(target, str) and name in _WIDTH_METHODS:
                    for a in values:
                        _check_int(a)
                        steps += abs(a) // ITEMS_PER_STEP if is_int(a) else 0
                _charge(context, steps + _method_steps(context, target, name, values))
                if isinstance(target, str):
                    if name in ("format", "format_map"):
                        _check_str_format(context, target, args, given)
                    else:
                        args = _check_str_method(context, name, target, args, given)
                    if name in _SPLITTING:
                        _check_room(context, _pieces_bytes(target, name, args, given))  # before they are made
                    if name in _EXPANDING:
                        _check_room(context, _expansion_bytes(name, target))
            result = super().call(context, obj, *args, **kwargs)
            # A string's method that returns a list or tuple returns pieces of it (`split`, `partition`).
            pieces = isinstance(obj, types.BuiltinMethodType) and isinstance(obj.__self__, str) and \
                isinstance(result, (list, tuple))
            _built(context, result, text=sys.getsizeof(obj.__self__) if pieces else 0)
            _charge(context, _size(result))
            return result

    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined,
                      extensions=[jinja2.ext.loopcontrols])
    env.filters["pprint"] = pass_context(_pformat)
    env.filters = {name: _metered_filter(name, f) for name, f in env.filters.items()}
    env.tests = {name: _metered_filter(name, f, is_test=True) for name, f in env.tests.items()}
    env.filters[_CHARGE] = pass_context(_charge_filter)
    env.filters[_TOUCH] = pass_context(_touch_filter)
    env.filters[_CONCAT] = pass_context(_concat_filter)
    env.filters[_COMPARE] = pass_context(_compare_filter)
    env.filters[_WRITE] = pass_context(_write_filter)
    # `lipsum(n)` writes n paragraphs of filler text in one call: no chat template uses it.
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise
    return env


@functools.lru_cache(maxsize=16)
def compiled_template(source: str):
    """`source` compiled in chat_environment, once per process for each template text (compiling a real chat
    template takes 10-15 ms, rendering it for a short chat well under 1 ms). A compiled template renders on several
    threads at once, each rendering with its own context and work budget; a template that does not compile raises
    every time (errors are not cached)."""
    return chat_environment().from_string(source)


def _raise(msg):
    raise DFlashError(f"the chat template refused these messages: {msg}", field="chat_template")
