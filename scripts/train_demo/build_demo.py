"""Build the demo model end to end, deterministically from a seed.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/train_demo/build_demo.py --work /tmp/demo_work --out mlx_spec/data/demo

Stages (``--stages``, default all, in order): ``data`` (stdlib corpus,
tokenizer, token streams), ``target`` (train the qwen3_next model), ``mtp``
(train its MTP head on the frozen target), ``export`` (raw Hugging Face
checkpoint into ``--out``). Each stage reads what the previous ones wrote
into ``--work``. Training stages checkpoint every ``ckpt_every`` steps and
resume from there when run again (a killed run loses at most that much). A
finished stage can be trained further with more warmup-stable-decay cycles
(``--set target_extra_steps=N`` or ``=[N1,N2]``, ``mtp_extra_steps``): it
resumes from the stage's last checkpoint. ``--preset tiny`` is the seconds-long version the
tests run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_config import get_config  # noqa: E402

STAGES = ("data", "target", "mtp", "export")


def _override(text: str):
    key, _, value = text.partition("=")
    return key, json.loads(value)


def run(
    preset: str, work: Path, out: Path, stages=STAGES, stop_after=None, **overrides
) -> dict:
    cfg = get_config(preset, **overrides)
    work, out = Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    (work / "build_config.json").write_text(cfg.to_json() + "\n")
    results = {}
    for stage in stages:
        t0 = time.time()
        if stage == "data":
            from demo_data import prepare_data

            m = prepare_data(
                work,
                cfg.seed,
                cfg.vocab_size,
                holdout=cfg.holdout,
                max_files=cfg.max_files,
                max_len=cfg.max_position_embeddings,
            )
            results["data"] = {
                k: m[k]
                for k in (
                    "num_files",
                    "train_tokens",
                    "eval_tokens",
                    "unigram_eval_loss",
                )
            }
        elif stage == "target":
            from demo_train import train_target

            results["target"] = train_target(cfg, work, stop_after=stop_after)[1]
        elif stage == "mtp":
            from demo_train_mtp import train_mtp

            results["mtp"] = train_mtp(cfg, work, stop_after=stop_after)[1]
        elif stage == "export":
            from demo_export import export

            results["export"] = export(cfg, work, out)
        else:
            raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
        if stage in results and results[stage] is None:
            print(f"[build] {stage} stopped after {stop_after} steps", flush=True)
            break  # resumable: the same command continues from the checkpoint
        print(f"[build] {stage} done in {time.time() - t0:.1f}s", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="demo", choices=("demo", "tiny"))
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument(
        "--set",
        type=_override,
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a config field, e.g. --set target_steps=100",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="end this run after N training steps of the current stage "
        "(checkpointed; the same command resumes)",
    )
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    results = run(
        args.preset, args.work, args.out, stages, args.stop_after, **dict(args.set)
    )
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
