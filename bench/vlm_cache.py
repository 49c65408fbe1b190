"""The token cache of image records grows with the records, not with their pixels (issue 45).

    python bench/vlm_cache.py [--records 10000 100000] [--scale 1 8] [--work /tmp/lit_hbp_vlm_cache]

The records are the tiny VLM demo's (``lit_hbp.demo.vision``: LLaMA-Factory style, 1-2 drawn images each,
relative paths), cycled to --records lines; --scale redraws every image that many times larger on each
side (the same shapes; the LLaVA-NeXT processor cuts a larger image into more tiles, so its samples get
somewhat more image tokens). For each size
and scale a fresh process runs ``HBPDataModule(tokenizer=<the demo checkpoint>).setup("fit")`` on a cold
cache: wall time, records/s, its peak RSS above a process that imported the same modules and loaded the
processor, the cache's bytes on disk, and beside them the bytes of the images' decoded pixels (what a
cache of pixels would hold) and of the image files.

Bar: from the smallest to the largest --scale the pixels grow scale^2 times and the cache's bytes per
record at most 1.5 times (ids, image references and sizes, never pixels); peak RSS above import stays
under 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def ensure_inputs(work: Path, n: int, scale: int) -> Path:
    """The demo (built once), its images redrawn ``scale`` times larger, and ``n`` records cycling over it."""
    from PIL import Image

    from lit_hbp.demo.vision import ensure_vlm_demo

    demo = work / "demo_vlm"
    ensure_vlm_demo(demo)
    folder = work / f"x{scale}"
    images = folder / "images"
    if not images.is_dir():
        images.mkdir(parents=True)
        for path in sorted((demo / "images").glob("*.png")):
            im = Image.open(path)
            im.resize((im.width * scale, im.height * scale), Image.NEAREST).save(images / path.name)
    data = folder / f"records_{n}.jsonl"
    if not data.exists():
        lines = (demo / "chat.jsonl").read_text().splitlines()
        with data.open("w") as f:
            for i in range(n):
                f.write(lines[i % len(lines)] + "\n")
    return data


def child(args) -> dict:
    """One cold set-up in this process (``--child``)."""
    import numpy as np
    from PIL import Image

    from lit_hbp import HBPDataModule
    from lit_hbp.lightning.datamodule import load_processor

    load_processor(args.model)
    base = peak_rss()
    cache = Path(args.cache)
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    dm = HBPDataModule(sources=[args.data], tokenizer=args.model, levels=[2048], cache_dir=str(cache), val_fraction=0)
    dm.setup("fit")
    seconds = time.perf_counter() - start
    store = dm.store
    counts = store.media_counts()
    files = {m[0] for i in range(min(len(counts), 2000)) for m in store.media(i)}
    per_file = {f: Image.open(f).size for f in files}
    pixel_bytes = np.mean([w * h * 3 for w, h in per_file.values()]) * counts.sum()
    return {
        "records": int(store.lengths.size),
        "images": int(counts.sum()),
        "seconds": seconds,
        "rss_above_import": peak_rss() - base,
        "cache_bytes": sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()),
        "pixel_bytes": float(pixel_bytes),
        "file_bytes": float(np.mean([Path(f).stat().st_size for f in files]) * counts.sum()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, nargs="+", default=[10_000])
    p.add_argument("--scale", type=int, nargs="+", default=[1, 8])
    p.add_argument("--work", type=Path, default=Path("/tmp/lit_hbp_vlm_cache"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.records:
        for scale in args.scale:
            data = ensure_inputs(args.work, n, scale)
            model = args.work / "demo_vlm" / "model"
            cmd = [sys.executable, __file__, "--child", "--data", str(data), "--model", str(model),
                   "--cache", str(args.work / "cache")]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            r = {"scale": scale, **json.loads(out.strip().splitlines()[-1])}
            rows.append(r)
            print(
                f"{r['records']:>8,} records x{scale}: {r['images']:,} images, {r['seconds']:.1f} s "
                f"({r['records'] / r['seconds']:,.0f} records/s), "
                f"peak RSS above import {r['rss_above_import'] / 2**20:.0f} MiB, "
                f"cache {r['cache_bytes'] / 2**20:.1f} MiB ({r['cache_bytes'] / r['records']:.0f} B/record), "
                f"pixels {r['pixel_bytes'] / 2**20:,.0f} MiB, image files {r['file_bytes'] / 2**20:,.0f} MiB",
                flush=True,
            )
    shutil.rmtree(args.work / "cache", ignore_errors=True)
    lo, hi = min(args.scale), max(args.scale)
    by = {(r["records"], r["scale"]): r["cache_bytes"] / r["records"] for r in rows}
    growth = max(by[(n, hi)] / by[(n, lo)] for n in {r["records"] for r in rows})
    same = growth <= 1.5
    rss = max(r["rss_above_import"] for r in rows)
    print(
        f"cache bytes per record x{hi} / x{lo}: {growth:.2f} (pixels {hi * hi / (lo * lo):.0f}x) <= 1.5: "
        f"{'PASS' if same else 'FAIL'}; peak RSS above import {rss / 2**30:.2f} GiB <= 1 GiB: "
        f"{'PASS' if rss <= 2**30 else 'FAIL'}"
    )
    return 0 if same and rss <= 2**30 else 1


if __name__ == "__main__":
    raise SystemExit(main())
