"""The TensorRT backend's parts that run without TensorRT: the plugin contract on ONNX graphs, the optimization
profiles against the real exported graphs (run through ONNX Runtime), Triton AOT compilation of the plugin kernels,
and the one-line errors when TensorRT or a GPU is missing."""

import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from onnx import TensorProto, helper

from dflash_export.engines import tensorrt as trt_backend
from dflash_export.engines import tensorrt_plugins as trt_plugins
from dflash_export.errors import DFlashError, MissingDependency
from dflash_export.export import ops

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def _attention_model(**overrides):
    attrs = dict(num_heads=4, num_kv_heads=2, scale=0.25, **ops.plugin_attrs())
    attrs.update(overrides)
    attrs = {k: v for k, v in attrs.items() if v is not None}
    node = helper.make_node(ops.KV_ATTENTION, ["q", "kc", "vc", "kb", "vb"], ["out"], name="attn0",
                            domain=ops.DOMAIN, **attrs)
    f = TensorProto.FLOAT
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info("q", f, [1, 4, 4, 16]),
        *[helper.make_tensor_value_info(n, f, [1, 2, "T", 16]) for n in ("kc", "vc")],
        *[helper.make_tensor_value_info(n, f, [1, 2, 4, 16]) for n in ("kb", "vb")],
    ], [helper.make_tensor_value_info("out", f, [1, 4, 4, 16])])
    return ops.make_model(graph, [ops.kv_injected_block_attention_function()])


def test_plugin_names_and_attributes_are_the_export_contract():
    assert (trt_backend.PLUGIN_NAMESPACE, trt_backend.PLUGIN_VERSION) == (ops.PLUGIN_NAMESPACE, ops.PLUGIN_VERSION)
    assert set(trt_backend.PLUGINS) == {ops.KV_ATTENTION, ops.FUSED_VERIFY}
    for op, spec in trt_backend.PLUGINS.items():
        assert set(spec.attributes) | {"plugin_namespace", "plugin_version"} == set(ops.REQUIRED_ATTRS[op])


def test_check_plugin_attributes_accepts_both_ops():
    assert trt_backend.check_plugin_attributes(_attention_model()) == {ops.KV_ATTENTION: 1}
    assert trt_backend.check_plugin_attributes(ops.fused_verify_model(0.0)) == {ops.FUSED_VERIFY: 1}


@pytest.mark.parametrize("overrides,field", [
    ({"plugin_version": None}, "plugin_version"),
    ({"plugin_version": "2"}, "plugin_version"),
    ({"plugin_namespace": "other"}, "plugin_namespace"),
    ({"scale": None}, "scale"),
    ({"scale": 1}, "scale"),
    ({"num_heads": 3}, "num_heads"),
])
def test_check_plugin_attributes_rejects_a_node_the_plugin_would_not_take(overrides, field):
    with pytest.raises(DFlashError, match=field):
        trt_backend.check_plugin_attributes(_attention_model(**overrides))


def test_check_plugin_attributes_rejects_unknown_ops_arity_and_missing_opset(tmp_path):
    model = _attention_model()
    model.graph.node[0].op_type = "BlockAttention"
    with pytest.raises(DFlashError, match="no plugin registered"):
        trt_backend.check_plugin_attributes(model)
    model = _attention_model()
    del model.graph.node[0].input[4]
    with pytest.raises(DFlashError, match="4 inputs"):
        trt_backend.check_plugin_attributes(model)
    model = _attention_model()
    del model.opset_import[1]
    with pytest.raises(DFlashError, match="opset_import"):
        trt_backend.check_plugin_attributes(model)
    (tmp_path / "bad.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(DFlashError, match="bad.onnx"):
        trt_backend.check_plugin_attributes(tmp_path / "bad.onnx")


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from dflash_export.export import export_recipe
    from dflash_export.recipes import load_recipe

    recipe = load_recipe("tiny-qwen3")
    out = tmp_path_factory.mktemp("export") / "onnx"
    export_recipe(recipe, out)
    return recipe, out


def _aot_flags(model) -> list:
    """The `aot` attribute of every dflash plugin node (None where absent), as TensorRT's parser reads it: an INT."""
    from onnx import AttributeProto

    flags = []
    for node in model.graph.node:
        if node.domain == "dflash":
            attr = [a for a in node.attribute if a.name == "aot"]
            flags.append(attr[0].i if attr and attr[0].type == AttributeProto.INT else None)
    return flags


def test_exported_graphs_carry_plugin_ready_nodes(tiny_export):
    """Every plugin node carries the lookup attributes and `aot` = 1 as an INT attribute: what TensorRT's ONNX
    parser reads (`attrs.get<int>("aot")`, onnx-tensorrt) to make a strict AOT plugin request, as NVIDIA's
    quickly-deployable-plugins sample marks its node."""
    import onnx

    _, out = tiny_export
    assert trt_backend.check_plugin_attributes(out / trt_backend.DRAFTER_ONNX) == {ops.KV_ATTENTION: 2}
    assert trt_backend.check_plugin_attributes(out / trt_backend.TARGET_ONNX) == {ops.FUSED_VERIFY: 1}
    for name, n in ((trt_backend.DRAFTER_ONNX, 2), (trt_backend.TARGET_ONNX, 1)):
        model = onnx.load(str(out / name), load_external_data=False)
        assert _aot_flags(model) == [1] * n, name
        for f in model.functions:
            if f.domain == "dflash":
                assert "aot" in f.attribute, f.name  # the function declares what its node carries


def test_the_aot_attribute_leaves_onnx_runtime_running_the_function_body():
    """ONNX Runtime inlines the dflash function of a node that carries `aot`: FusedVerify's outputs equal the
    torch reference (kernels/reference.py) for greedy and sampled verification."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from dflash_export.kernels.reference import fused_verify_ref

    g = torch.Generator().manual_seed(0)
    for temperature in (0.0, 0.8):
        model = ops.fused_verify_model(temperature, vocab_size=12)
        assert _aot_flags(model) == [1]
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        logits = torch.randn(2, 5, 12, generator=g) * 3
        drafts = torch.randint(0, 12, (2, 4), generator=g)
        probs = torch.softmax(torch.randn(2, 4, 12, generator=g), -1)
        unif = torch.rand(2, 5, generator=g)
        got = sess.run(None, {"target_logits": logits.numpy(), "draft_tokens": drafts.numpy(),
                              "draft_probs": probs.numpy(), "uniforms": unif.numpy()})
        for a, b in zip(got, fused_verify_ref(logits, drafts, probs, unif, temperature)):
            np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize("value", [2, -1, 1.0, "1"])
def test_check_plugin_attributes_rejects_an_aot_attribute_tensorrt_would_misread(value):
    from onnx import helper

    model = _attention_model()
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != "aot"]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute("aot", value)])
    with pytest.raises(DFlashError) as err:
        trt_backend.check_plugin_attributes(model)
    assert err.value.field == "aot"


@pytest.mark.parametrize("graph", ["target_verify", "drafter"])
def test_every_profile_describes_inputs_the_exported_graph_runs_with(tiny_export, graph):
    """Each profile's opt shapes, fed to ONNX Runtime on the real graph, give outputs of the expected sizes; min and
    max stay inside 1..max_seq_len (so a TensorRT build would accept the ranges)."""
    import onnx
    import onnxruntime as ort

    recipe, out = tiny_export
    path = out / f"{graph}.onnx"
    model = onnx.load(str(path), load_external_data=False)
    vocab = trt_backend.vocab_size_of(model)
    assert vocab == 256
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for profile in trt_backend.graph_profiles(graph, 4, recipe.max_seq_len, vocab):
        shapes = trt_backend.profile_shapes(model, profile)
        assert set(shapes) == {i.name for i in model.graph.input}
        for lo, opt, hi in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)) and max(hi, default=0) <= recipe.max_seq_len
        feeds = trt_backend.example_feeds(model, profile)
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        if graph == "target_verify":
            n = int(feeds["num_logits"])
            assert results["logits"].shape == (1, n, vocab)
            assert results["emitted_tokens"].shape == (1, n) and int(results["n_emitted"][0]) >= 1
        else:
            assert results["draft_logits"].shape == (1, 3, vocab)
            total = feeds["past_ctx_key_0"].shape[2] + feeds["ctx"].shape[1]
            assert results["present_ctx_key_0"].shape[2] == total


def test_profiles_name_every_dynamic_dim_or_fail_clearly():
    import onnx

    with pytest.raises(DFlashError, match="unknown graph"):
        trt_backend.graph_profiles("draft_head", 4, 64, 10)  # lm_head is a batch graph (tensorrt_batch)
    model = ops.fused_verify_model(0.0, vocab_size=10)
    profile = trt_backend.Profile("p", {"B": (1, 1, 1)})
    with pytest.raises(DFlashError, match="'bs'"):
        trt_backend.profile_shapes(model, profile)
    assert isinstance(model, onnx.ModelProto)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_plugin_kernels_compile_ahead_of_time_to_ptx():
    """What aot_impl hands TensorRT: PTX for sm_90 of both entry points, compiled here without a GPU (in a fresh
    process: the test process may run triton in interpreter mode), whose .entry declares exactly the parameters
    TensorRT passes (Triton's trailing scratch pointers removed)."""
    code = textwrap.dedent("""
        from triton.backends.compiler import GPUTarget
        from dflash_export.engines.tensorrt import compile_attention_aot, compile_verify_aot
        target = GPUTarget("cuda", 90, 32)
        kernels = [compile_attention_aot("bfloat16", 128 ** -0.5, 128, 64, target),
                   compile_attention_aot("float32", 0.25, 16, 32, target),
                   compile_verify_aot("float32", 0.0, 16, target=target),
                   compile_verify_aot("bfloat16", 0.7, 16, target=target)]
        from dflash_export.engines.tensorrt_ptx import parse_entry
        # what TensorRT passes: 5 input pointers, 5 int32 extra args, 1 output pointer / 4 + 2 + 3
        want = {"kv_injected_block_attention_aot_kernel": [64] * 5 + [32] * 5 + [64],
                "fused_verify_aot_kernel": [64] * 4 + [32] * 2 + [64] * 3}
        for k in kernels:
            assert k.num_warps > 0, k.name
            assert [p.bits for p in parse_entry(k.ptx, k.name).params] == want[k.name], k.name
            assert k.params == len(want[k.name])
        print("ok", [k.name for k in kernels])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
def test_without_tensorrt_every_entry_point_names_the_extra_and_the_gpu(tmp_path):
    from dflash_export.recipes import load_recipe

    pattern = r"dflash-export\[tensorrt\].*NVIDIA GPU"
    with pytest.raises(MissingDependency, match=pattern):
        trt_backend.build_tensorrt(load_recipe("tiny-qwen3"), tmp_path / "engine")
    assert not (tmp_path / "engine").exists()
    with pytest.raises(MissingDependency, match=pattern):
        trt_backend.register_plugins()
    with pytest.raises(MissingDependency, match=pattern):
        trt_backend.compare_onnxruntime_tensorrt(tmp_path)
    with pytest.raises(MissingDependency, match=pattern):
        trt_backend.build_tensorrt_engines(tmp_path, tmp_path, load_recipe("tiny-qwen3"))
    with pytest.raises(MissingDependency, match=pattern):  # before any plain-op graph is written
        trt_backend.build_batch_engines(tmp_path, tmp_path, 4, 512, "float32")
    assert not list(tmp_path.glob("*.onnx"))


def test_example_feeds_are_valid_ids_and_distributions():
    model = ops.fused_verify_model(1.0, vocab_size=12)
    profile = trt_backend.Profile("p", {"B": (1, 2, 2), "bs": (4, 4, 4), "n": (3, 3, 3), "n_or_1": (3, 3, 3),
                                        "V_or_1": (12, 12, 12), "bs_or_1": (4, 4, 4)})
    feeds = trt_backend.example_feeds(model, profile, vocab_size=12)
    assert feeds["draft_tokens"].dtype == np.int64 and feeds["draft_tokens"].max() < 12
    assert np.allclose(feeds["draft_probs"].sum(-1), 1.0, atol=1e-5)
    assert feeds["uniforms"].shape == (2, 4) and 0 <= feeds["uniforms"].min()


class _Expr:
    """A stand-in for tensorrt.plugin's ShapeExpr: arithmetic kept as text, optional build-time constant."""

    def __init__(self, text, const=None):
        self.text, self._const = str(text), const

    @property
    def is_constant(self):
        return self._const is not None

    def constant_value(self):
        return self._const

    def __mul__(self, other):
        return _Expr(f"({self.text}*{getattr(other, 'text', other)})")


def _fake_tensorrt(monkeypatch, aot: bool = True):
    """Install stand-in `tensorrt` / `tensorrt.plugin` modules that record what register_plugins declares.

    This proves the glue is self-consistent (every decorator gets a callable whose annotations evaluate, each
    function runs on descriptor-like inputs); it cannot prove TensorRT accepts it — only a TensorRT install can.
    The stand-in follows tensorrt.plugin's sources where it matters: `aot_impl` is always exported, but
    `KernelLaunchParams` and `trt.QuickPluginCreationRequest` exist only on an AOT-capable TensorRT (`aot=False`
    models one without)."""
    import types

    registry = {}
    trtp = types.ModuleType("tensorrt.plugin")

    def decorator(kind):
        def factory(plugin_id):
            def wrap(fn):
                registry[(kind, plugin_id)] = fn
                return fn
            return wrap
        return factory

    for kind in ("register", "autotune", "aot_impl", "impl"):
        setattr(trtp, kind, decorator(kind))

    class TensorDesc:
        def __init__(self, shape_expr=(), dtype="float32"):
            self.shape_expr, self.dtype = shape_expr, dtype

        def like(self):
            return TensorDesc(self.shape_expr, self.dtype)

    class AutoTuneCombination:
        def __init__(self, types=""):
            self.types, self.tactic_ids = types, []

        def tactics(self, ids):
            self.tactic_ids = ids

    class KernelLaunchParams:
        grid_x = grid_y = grid_z = block_x = shared_mem = None

    trtp.TensorDesc, trtp.Tensor, trtp.AutoTuneCombination = TensorDesc, object, AutoTuneCombination
    trtp.SymExprs = tuple
    if aot:
        trtp.KernelLaunchParams = KernelLaunchParams
    trtp.SymInt32 = lambda e: ("i32", getattr(e, "text", e))
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.cdiv = lambda a, b: f"cdiv({getattr(a, 'text', a)},{b})"
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(shape, dtype)
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "11.4.0.106"  # a release whose plugin creator works with any numpy (tests/trt_lane.py)
    trt.float32, trt.float16, trt.bfloat16, trt.int64, trt.int32 = "float32", "float16", "bfloat16", "int64", "int32"
    trt.plugin = trtp
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0, PREFER_AOT_PYTHON_PLUGINS=1)
    if aot:
        trt.QuickPluginCreationRequest = types.SimpleNamespace(PREFER_AOT=1)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    # patched where they are defined (tensorrt_plugins); trt_backend re-exports the public names
    monkeypatch.setattr(trt_plugins, "tensorrt_available", lambda: True)
    monkeypatch.setattr(trt_plugins, "_REGISTERED", False)
    compiled = []

    def fake_compile(fn, signature, constexprs, target=None):
        compiled.append((fn.__name__ if hasattr(fn, "__name__") else str(fn), signature, constexprs))
        return trt_backend.AotKernel("k", ".entry k", 4, 1024, len(signature))

    monkeypatch.setattr(trt_plugins, "_compile", fake_compile)
    return registry, trtp, compiled


def test_register_plugins_declares_shapes_autotune_and_aot_launches(monkeypatch):
    pytest.importorskip("triton")
    registry, trtp, compiled = _fake_tensorrt(monkeypatch)
    trt_backend.register_plugins()
    attn, verify = "dflash::KVInjectedBlockAttention", "dflash::FusedVerify"
    assert {k for k in registry} == {(kind, p) for kind in ("register", "autotune", "aot_impl", "impl")
                                     for p in (attn, verify)}
    B, H, S, D, KVH, T = _Expr("B"), _Expr("H", 32), _Expr("S"), _Expr("D", 128), _Expr("KVH", 8), _Expr("T")
    q = trtp.TensorDesc((B, H, S, D), "bfloat16")
    kc = trtp.TensorDesc((B, KVH, T, D), "bfloat16")
    kb = trtp.TensorDesc((B, KVH, S, D), "bfloat16")
    out = registry[("register", attn)](q, kc, kc, kb, kb, 32, 8, 128 ** -0.5)
    assert out.shape_expr == q.shape_expr and out.dtype == "bfloat16"
    (combo,) = registry[("autotune", attn)](q, kc, kc, kb, kb, 32, 8, 0.1, (out,))
    assert combo.types.count("FP32|FP16|BF16") == 6 and combo.tactic_ids == list(trt_backend.ATTENTION_TACTICS)
    name, ptx, launch, extra = registry[("aot_impl", attn)](q, kc, kc, kb, kb, 32, 8, 128 ** -0.5, (out,), 2)
    assert (name, ptx) == (b"k", b".entry k") and launch.block_x == 128 and launch.shared_mem == 1024
    assert launch.grid_x.text == "(B*H)" and launch.grid_y == f"cdiv(S,{trt_backend.ATTENTION_BLOCK_M})"
    assert [e[1] for e in extra] == ["H", "KVH", "S", "T", "D"]  # the AOT kernel's int32 arguments, in order
    fn, signature, constexprs = compiled[-1]
    assert list(signature)[:11] == ["q_ptr", "kc_ptr", "vc_ptr", "kb_ptr", "vb_ptr", "H", "KVH", "S", "T", "D",
                                    "o_ptr"]
    assert signature["q_ptr"] == "*bf16" and constexprs["BLOCK_N"] == trt_backend.ATTENTION_TACTICS[2]
    assert constexprs["BLOCK_D"] == 128 and constexprs["PRECISION"] is None

    # num_logits is 1 in the prefill / decode profiles and block_size in verify: never a build-time constant
    V, BS = _Expr("V"), _Expr("num_logits")
    logits = trtp.TensorDesc((B, BS, V), "float32")
    toks, probs, unif = (trtp.TensorDesc((B, _Expr("n")), "int64"), trtp.TensorDesc((B, 1, 1), "float32"),
                         trtp.TensorDesc((B, 1), "float32"))
    outs = registry[("register", verify)](logits, toks, probs, unif, 0.0)
    assert [o.dtype for o in outs] == ["int64"] * 3 and outs[1].shape_expr == (B, BS)
    name, ptx, launch, extra = registry[("aot_impl", verify)](logits, toks, probs, unif, 0.0, outs, 0)
    assert launch.grid_x is B
    assert [e[1] for e in extra] == ["num_logits", "V"]  # the row count reaches the kernel at run time
    fn, signature, constexprs = compiled[-1]
    # the tile is fixed and the kernel loops over the rows (test_kernels runs these constants at 1, 4 and 70 rows)
    assert constexprs == trt_backend.verify_aot_constexprs(0.0) and constexprs["GREEDY"] is True
    assert list(signature)[4:6] == ["BS", "V"] and signature["accept_ptr"] == "*i64"
    trt_backend.register_plugins()  # idempotent
    assert len(compiled) == 2
    # a head_dim TensorRT cannot give at build time is refused by name, not guessed
    q_dyn = trtp.TensorDesc((B, H, S, _Expr("D")), "float16")
    with pytest.raises(DFlashError, match="head_dim"):
        registry[("aot_impl", attn)](q_dyn, kc, kc, kb, kb, 32, 8, 0.1, (out,), 1)


def test_register_plugins_without_aot_support_registers_only_the_jit_impl(monkeypatch):
    """tensorrt.plugin exports aot_impl everywhere, but KernelLaunchParams only where AOT plugins exist: there the
    aot_impl (whose annotations name KernelLaunchParams) must not be declared at all."""
    registry, trtp, _ = _fake_tensorrt(monkeypatch, aot=False)
    assert hasattr(trtp, "aot_impl") and not hasattr(trtp, "KernelLaunchParams")
    trt_backend.register_plugins()
    assert {kind for kind, _ in registry} == {"register", "autotune", "impl"}
    import tensorrt

    assert not trt_backend.aot_plugins_supported(tensorrt, trtp)


def test_jit_impl_views_bf16_through_an_int16_array_interface():
    """TensorRT's Tensor.__cuda_array_interface__ raises for bf16 (numpy has no bfloat16): the JIT impl describes the
    buffer as int16 and reinterprets it. The same description read through numpy's __array_interface__ on the CPU
    gives back the bf16 values, strided layouts included."""
    import torch

    x = torch.randn(3, 5, dtype=torch.float32).to(torch.bfloat16)
    base = torch.empty(5, 3, dtype=torch.bfloat16)
    base.copy_(x.t())
    view = base.t()  # non-contiguous [3, 5]
    for t in (x, view):
        desc, view_as = trt_backend.array_interface(t.data_ptr(), t.shape, t.stride(), "bfloat16")
        assert desc["typestr"] == "<i2" and view_as == "bfloat16" and "stream" not in desc
        assert desc["strides"] == tuple(2 * st for st in t.stride())

        class Host:
            __array_interface__ = {**desc, "version": 3}

        back = torch.from_numpy(np.array(np.asarray(Host()))).view(torch.bfloat16)
        assert torch.equal(back, t)
    desc, view_as = trt_backend.array_interface(1024, (2, 2), (2, 1), "float16")
    assert (desc["typestr"], desc["strides"], view_as) == ("<f2", (4, 2), None)
    with pytest.raises(DFlashError, match="dtype"):
        trt_backend.array_interface(1024, (2,), (1,), "float8")


def test_implementation_recorded_is_the_one_tensorrt_called():
    counts = {"KVInjectedBlockAttention": 2, "FusedVerify": 1}
    calls = {"KVInjectedBlockAttention": {trt_backend.IMPL_AOT}, "FusedVerify": {trt_backend.IMPL_JIT}}
    assert trt_backend.build_implementations(counts, calls) == {"KVInjectedBlockAttention": trt_backend.IMPL_AOT,
                                                                 "FusedVerify": trt_backend.IMPL_JIT}
    assert trt_backend.build_implementations(counts, {}) == dict.fromkeys(counts, trt_backend.IMPL_JIT)
    facts = {"a.engine": {"implementation": {"FusedVerify": trt_backend.IMPL_AOT}},
             "b.engine": {"implementation": {"FusedVerify": trt_backend.IMPL_JIT,
                                             "KVInjectedBlockAttention": trt_backend.IMPL_AOT}}}
    assert trt_backend.plugin_implementations(facts) == {
        "FusedVerify": f"{trt_backend.IMPL_AOT} + {trt_backend.IMPL_JIT}",
        "KVInjectedBlockAttention": trt_backend.IMPL_AOT}


def test_plugin_layers_are_counted_from_the_engine_inspector_and_checked(tmp_path):
    import json

    # the shape of IEngineInspector's JSON with ProfilingVerbosity.DETAILED: one record per layer
    layers = [{"Name": "/layers.0/attn", "LayerType": "PluginV3", "PluginType": "KVInjectedBlockAttention"},
              {"Name": "/layers.1/attn", "LayerType": "PluginV3", "PluginType": "KVInjectedBlockAttention"},
              {"Name": "/lm_head/MatMul", "LayerType": "Gemm"},
              {"Name": "verify", "LayerType": "PluginV3", "Metadata": "dflash::FusedVerify v1"}]
    info = json.dumps({"Layers": layers, "Bindings": ["q"]})
    counts = trt_backend.plugin_layer_counts(info)
    assert counts == {"KVInjectedBlockAttention": 2, "FusedVerify": 1}
    trt_backend.check_plugin_layers({"KVInjectedBlockAttention": 2, "FusedVerify": 1}, counts, tmp_path / "e")
    with pytest.raises(DFlashError, match=r"plugin_layers: built engine holds 1 dflash::FusedVerify.*graph has 2"):
        trt_backend.check_plugin_layers({"FusedVerify": 2}, counts, tmp_path / "e")
    with pytest.raises(DFlashError, match="holds 0 dflash::KVInjectedBlockAttention"):
        trt_backend.check_plugin_layers({"KVInjectedBlockAttention": 2}, {}, tmp_path / "e")
    # an engine built without DETAILED verbosity lists layer names only: no verdict, and the caller refuses
    assert trt_backend.plugin_layer_counts(json.dumps({"Layers": ["a", "b"]})) is None


@pytest.mark.parametrize("trt_version, numpy_version, refused", [
    ("10.11.0.33", "2.3.5", "older than 10.12"),
    ("10.12.0.36", "2.3.5", None),
    ("10.16.1.11", "2.3.5", None),
    ("10.16.1.11", "2.4.0", "numpy 2.4.0"),
    ("11.1.0.106", "2.4.6", "numpy 2.4.6"),
    ("11.2.1.2", "2.4.6", None),
    ("10.14.1.48.post1", "2.3.5", None),
])
def test_check_versions_refuses_the_pairs_the_real_wheels_fail_with(trt_version, numpy_version, refused):
    """The pairs tests/trt_lane.py ran against NVIDIA's wheels: TensorRT < 11.2 creates no plugin under numpy >= 2.4
    (TypeError in tensorrt/plugin/_lib.py), and 10.12 is the oldest checked."""
    if refused is None:
        trt_plugins.check_versions(trt_version, numpy_version)
        return
    with pytest.raises(MissingDependency) as e:
        trt_plugins.check_versions(trt_version, numpy_version)
    assert refused in str(e.value) and "\n" not in str(e.value)


def _flags(*names):
    return types.SimpleNamespace(BuilderFlag=types.SimpleNamespace(**{n: n for n in names}), __version__="x")


def test_resolve_precision_follows_the_builder_flags_each_tensorrt_has():
    """TensorRT 10.x has BuilderFlag.FP16 / BF16 (a float32 graph lowered, the fp32 island obeyed); 11.x has none
    (every network strongly typed): float16 / bfloat16 build a graph of that type."""
    from dflash_export.engines.tensorrt_build import resolve_precision

    trt10 = _flags("FP16", "BF16", "TF32", "OBEY_PRECISION_CONSTRAINTS")
    trt11 = _flags("TF32")
    assert resolve_precision(trt10, "float32").clear_flags == ("TF32",)
    p = resolve_precision(trt10, "bfloat16")
    assert (p.strongly_typed, p.graph_dtype, p.set_flags, p.pin_fp32_island) == \
        (False, "float32", ("BF16", "OBEY_PRECISION_CONSTRAINTS"), True)
    p = resolve_precision(trt11, "float16")
    assert (p.strongly_typed, p.graph_dtype, p.set_flags) == (True, "float16", ())
    p = resolve_precision(trt11, "bfloat16")
    assert (p.strongly_typed, p.graph_dtype, p.set_flags, p.pin_fp32_island) == (True, "bfloat16", (), False)
    with pytest.raises(DFlashError, match="int8"):
        resolve_precision(trt11, "int8")


def test_graph_handed_to_tensorrt_names_the_plugins_without_their_function_bodies(tiny_export):
    """TensorRT parses a copy without the dflash model-local functions (an older parser would import a node with a
    local function as its body); the nodes, weights references and opset imports are the export's."""
    import onnx

    from dflash_export.engines.tensorrt_build import plugin_only_graph

    _, out = tiny_export
    for name in ("target_verify.onnx", "drafter.onnx"):
        src = out / name
        copy = plugin_only_graph(src)
        a, b = onnx.load(str(src), load_external_data=False), onnx.load(str(copy), load_external_data=False)
        assert any(f.domain == "dflash" for f in a.functions)
        assert not any(f.domain == "dflash" for f in b.functions)
        assert list(a.graph.node) == list(b.graph.node) and list(a.opset_import) == list(b.opset_import)
        assert list(a.graph.initializer) == list(b.graph.initializer)
        assert trt_plugins.check_plugin_attributes(b) == trt_plugins.check_plugin_attributes(a)


def test_graph_handed_to_tensorrt_asks_for_the_implementation_the_build_asked_for(tiny_export, tmp_path):
    """`aot` on every plugin node of the parsed copy: 1 for an AOT build, 0 for a JIT one (a strict request each,
    read by the parser before the network's PREFER_AOT flag); a node without it (a graph exported before the
    attribute) gets it; nothing else of the graph changes."""
    import onnx

    from dflash_export.engines.tensorrt_build import plugin_only_graph

    _, out = tiny_export
    for name, n in (("target_verify.onnx", 1), ("drafter.onnx", 2)):
        src = out / name
        a = onnx.load(str(src), load_external_data=False)
        for impl, flag in (("jit", 0), ("aot", 1)):
            b = onnx.load(str(plugin_only_graph(src, impl)), load_external_data=False)
            assert _aot_flags(b) == [flag] * n, (name, impl)
            assert trt_plugins.check_plugin_attributes(b) == trt_plugins.check_plugin_attributes(a)
            assert [(x.op_type, list(x.input), list(x.output)) for x in a.graph.node] == \
                   [(x.op_type, list(x.input), list(x.output)) for x in b.graph.node]
        old = onnx.load(str(src), load_external_data=False)
        for node in old.graph.node:
            kept = [x for x in node.attribute if x.name != "aot"]
            del node.attribute[:]
            node.attribute.extend(kept)
        assert _aot_flags(old) == [None] * n
        legacy = tmp_path / name  # the copy only references the weights, it never reads them
        onnx.save(old, str(legacy))
        assert _aot_flags(onnx.load(str(plugin_only_graph(legacy, "jit")), load_external_data=False)) == [0] * n
    with pytest.raises(DFlashError, match="unknown plugin implementation"):
        plugin_only_graph(out / "drafter.onnx", "python")


def test_weakly_typed_builds_pin_the_fp32_island_layers_and_only_them():
    """On TensorRT 10.x half builds, layers the parser named after fp32_island nodes ask for float32 (precision and
    float outputs); other layers and integer outputs are left to the builder."""
    from dflash_export.engines.tensorrt_build import pin_fp32_island
    from dflash_export.export.builder import FP32_ISLAND

    class Layer:
        def __init__(self, name, out_types):
            self.name, self.precision, self.outs, self.set = name, None, out_types, {}
            self.num_outputs = len(out_types)

        def get_output(self, j):
            return types.SimpleNamespace(dtype=self.outs[j])

        def set_output_type(self, j, t):
            self.set[j] = t

    trt = types.SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16")
    layers = [Layer(f"{FP32_ISLAND}n_ReduceMean_7", ["f16"]), Layer("n_MatMul_3", ["f16"]),
              Layer(f"{FP32_ISLAND}n_Shape_9_shape", ["i64"])]
    network = types.SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])
    assert pin_fp32_island(trt, network) == 2
    assert (layers[0].precision, layers[0].set) == ("f32", {0: "f32"})
    assert (layers[1].precision, layers[1].set) == (None, {})
    assert (layers[2].precision, layers[2].set) == ("f32", {})
