"""What a model's identity (every byte of its weights) costs at load.

Loads a model with an empty digest cache (every weight file is read and
hashed) and again with the cache filled (no weight file is read), and times
SHA-256 over a scratch file of ``--scratch-gb`` gigabytes, from which the
first load of a larger model is estimated (its files are hashed four at a
time; the estimate assumes one core, the lower bound).

    python scripts/bench_identity.py [--model DIR] [--rounds 3] [--scratch-gb 2]
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from mlx_spec import load
from mlx_spec.cache_dir import CACHE_DIR_ENV
from mlx_spec.demo import default_model_path
from mlx_spec.models import identity
from mlx_spec.models.identity import model_fingerprint


def timed_load(path):
    """Seconds of ``load`` alone, and of its first identity."""
    tic = time.perf_counter()
    model, _ = load(path)
    loaded = time.perf_counter()
    model_fingerprint(model)
    return loaded - tic, time.perf_counter() - loaded


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch-gb", type=float, default=2.0)
    args = parser.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    size = sum(f.stat().st_size for f in identity.weight_files(path))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[CACHE_DIR_ENV] = tmp
        cold, warm, load_s = [], [], []
        for _ in range(args.rounds):
            identity.digest_cache_file().unlink(missing_ok=True)
            seconds, first = timed_load(path)
            cold.append(first)
            load_s.append(seconds)
            warm.append(timed_load(path)[1])
        scratch = Path(tmp) / "scratch.bin"
        block = os.urandom(64 << 20)
        with open(scratch, "wb") as f:
            for _ in range(int(args.scratch_gb * 1024 / 64)):
                f.write(block)
        tic = time.perf_counter()
        identity.file_digests([scratch])
        rate = scratch.stat().st_size / (time.perf_counter() - tic)
    print(f"model: {path} ({size / 1e6:.1f} MB of weight files)")
    print(f"load alone: median {statistics.median(load_s):.3f} s")
    print(f"identity, empty cache: median {statistics.median(cold):.3f} s {cold}")
    print(f"identity, cache filled: median {statistics.median(warm):.4f} s {warm}")
    print(f"SHA-256 of a {args.scratch_gb:g} GB file: {rate / 1e9:.2f} GB/s")
    print(f"estimated first load of 20 GB of weights: {20e9 / rate:.0f} s more")


if __name__ == "__main__":
    main()
