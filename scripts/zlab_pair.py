"""Write a tiny pair built by z-lab's own release (dflash 0.1.0) to a directory, with a recipe and an id suite, so the
CLI stages can be run on it: python scripts/zlab_pair.py OUT_DIR KIND... (kinds: tests/test_zlab.py's KINDS).

    python scripts/zlab_pair.py /tmp/zdemo dflash2
    dflash-export build --recipe /tmp/zdemo/dflash2.yaml --out /tmp/zdemo/engines
    dflash-export validate --recipe /tmp/zdemo/dflash2.yaml --engine /tmp/zdemo/engines/zlab-dflash2/onnxruntime \\
        --suite /tmp/zdemo/suite.jsonl --max-new-tokens 32 --dist-samples 200
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_zlab as zt  # noqa: E402  (the builders the tests check against z-lab's dflash_generate)


def main(out: Path, kinds: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)

    class _Dirs:  # stands in for pytest's tmp_path_factory
        def mktemp(self, name):
            d = out / name
            d.mkdir(exist_ok=True)
            return d

    build_target = getattr(zt.zlab_target, "_get_wrapped_function", lambda: zt.zlab_target.__wrapped__)()
    target = build_target(_Dirs())
    for kind in kinds:
        zt._save_zlab_drafter(out / kind, kind)
        (out / f"{kind}.yaml").write_text(f"name: zlab-{kind}\ntarget: {target}\ndrafter: {out / kind}\n"
                                          "dtype: float32\nmax_seq_len: 256\nchat_template: false\n")
    with open(out / "suite.jsonl", "w") as f:
        for i, ids in enumerate(zt.PROMPTS * 3):
            f.write(json.dumps({"id": f"p{i}", "input_ids": [(x * (i + 1)) % 30 for x in ids]}) + "\n")
    print(out)


if __name__ == "__main__":
    from dflash_export.bench.script_args import refuse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, metavar="OUT_DIR", help="where the pair, its recipes and the suite are written")
    ap.add_argument("kinds", nargs="*", default=["dflash2"], metavar="KIND",
                    help=f"drafters to write, one recipe each (default dflash2; known: {', '.join(zt.KINDS)})")
    args = ap.parse_args()
    unknown = [k for k in args.kinds if k not in zt.KINDS]
    if unknown:
        refuse("KIND", f"unknown {unknown[0]!r} (known: {', '.join(zt.KINDS)})")
    main(args.out, args.kinds)
