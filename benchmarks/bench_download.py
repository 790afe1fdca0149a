"""Download throughput from the loopback fake Hub, as a ratio to curl on the same file in the same run.

    .venv/bin/python benchmarks/bench_download.py [--size-mb 300] [--runs 3] [--json]

Each run downloads the file once with curl and once with `desktop.core.hub.download.pull` (which also computes
the sha256 and lays the file out in the HF cache), alternating so both see the same machine load. The ratio is
the median over runs of (switchyard MB/s / curl MB/s); the target is >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from desktop.core.hub.download import RetryPolicy, pull  # noqa: E402


def make_file(path: Path, size_mb: int) -> None:
    block = os.urandom(1 << 20)
    with path.open("wb") as f:
        for i in range(size_mb):
            f.write(block[i % 251 :] + block[: i % 251])  # distinct blocks, cheap to make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    curl = shutil.which("curl")
    if curl is None:
        print("curl is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-download-") as tmp:
        root = Path(tmp)
        source = root / "repos" / "big-GGUF" / "model-Q4_K_M.gguf"
        source.parent.mkdir(parents=True)
        make_file(source, args.size_mb)
        size = source.stat().st_size
        rows = []
        # The fake Hub runs in its own process, so neither client shares a GIL with the server.
        server = subprocess.Popen(  # noqa: S603
            [sys.executable, str(Path(__file__).resolve().parents[1] / "tests" / "fakehub.py"), str(root / "repos")],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline().strip()
            if not line.startswith("HF_ENDPOINT="):
                print(f"fake hub did not start: {line!r}", file=sys.stderr)
                return 2
            endpoint = line.split("=", 1)[1]
            os.environ["HF_ENDPOINT"] = endpoint
            url = f"{endpoint}/demo/big-GGUF/resolve/main/{source.name}"
            for run in range(args.runs):
                out = root / "curl.out"
                t0 = time.perf_counter()
                subprocess.run([curl, "-sS", "-f", "-o", str(out), url], check=True)  # noqa: S603
                curl_s = time.perf_counter() - t0
                out.unlink()
                cache_dir = root / f"cache{run}"
                t0 = time.perf_counter()
                result = pull("demo/big-GGUF:Q4_K_M", cache_dir=cache_dir, policy=RetryPolicy())
                ours_s = time.perf_counter() - t0
                assert result.downloaded_bytes == size
                shutil.rmtree(cache_dir)
                row = {
                    "run": run,
                    "curl_MBps": size / curl_s / 1e6,
                    "switchyard_MBps": size / ours_s / 1e6,
                    "ratio": curl_s / ours_s,
                }
                rows.append(row)
                if not args.json:
                    print(f"run {run}: curl {row['curl_MBps']:.0f} MB/s, switchyard {row['switchyard_MBps']:.0f} MB/s "
                          f"(includes sha256 + HF cache layout), ratio {row['ratio']:.2f}", flush=True)
        finally:
            server.terminate()
            server.wait(10)
    summary = {
        "file_MB": size / 1e6,
        "runs": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "target": 0.9,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"median ratio switchyard/curl: {summary['median_ratio']:.2f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
