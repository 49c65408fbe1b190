"""What lit-hbp does on this GPU, in one run: the parts of ``bench/gpu_proof.sh`` (which installs first).

    bash bench/gpu_proof.sh [--out DIR] [--parts env,demo,tests,throughput,peers,vlm,sp2]
    bash bench/gpu_proof.sh --dry-run      # CPU: the same parts on the tiny config, a few steps

Parts, each in its own process with its own time box, so one that fails or runs over still leaves the
others' results:

- env: versions (Python, torch, CUDA, transformers, Lightning, DeepSpeed, TRL, flash-attn, Liger), GPUs;
- demo: the embedded demo data the configs train on (built once);
- tests: ``pytest -m gpu`` (backends against the fp32 definition, loss and gradient parity, compile,
  CP kernels, offload streams, Liger, the host-sync audit);
- throughput: ``bench/gpu_throughput.py`` on configs/llama_1b_1gpu.yaml: tokens/s and MFU per level,
  lit-hbp beside HF Trainer on the same packs, the memory model's prediction against
  ``torch.cuda.max_memory_allocated`` per level, the attention backend each kind of layer call chose and why;
- peers: ``bench/peers.py`` at the 1B size: lit-hbp's CLI, TRL (BFD + padding-free, no packing), HF
  Trainer with dynamic padding, with the check that each mode keeps samples apart;
- vlm: configs/tiny_vlm_cpu.yaml (a tiny LLaVA-NeXT on drawn-shape image chats) on one GPU in bf16: the
  self-check with the run's own images, then 60 steps of image packs (the per-level table);
- sp2 (2+ GPUs only): the 1B config with one level, 16K tokens at sp 2, 20 steps on every GPU here.

Writes ``proof.json`` (everything), ``proof.md`` (the tables) and ``proof.log`` (each part's output) to
--out (default: $OUT when set, else runs/gpu_proof) and prints a one-screen summary. Exit status 0 when
every part that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = ("env", "demo", "tests", "throughput", "peers", "vlm", "sp2")
# Seconds per part on one H100/H200: with the install before them (~25 s) the boxes add up to 9 minutes.
# Building the demo data takes ~11 s on a 2-core CPU (none when demo_data/ came with the checkout).
BOXES = {"env": 30, "demo": 30, "tests": 80, "throughput": 130, "peers": 180, "vlm": 60, "sp2": 90}
PACKAGES = ("torch", "transformers", "lightning", "deepspeed", "trl", "flash_attn", "liger_kernel", "peft")


def env_part(_: argparse.Namespace, work: Path) -> dict:
    """Versions and devices (in a child process: a broken install shows here, not as a crash)."""
    code = (  # imports only: without the cyclic collector's walks over them (seconds)
        "import gc; gc.disable()\n"
        "import importlib, json, platform, torch\n"
        "out = {'python': platform.python_version(), 'cuda': torch.version.cuda,\n"
        "       'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}\n"
        f"for name in {PACKAGES!r}:\n"
        "    try:\n"
        "        out[name] = getattr(importlib.import_module(name), '__version__', 'installed')\n"
        "    except Exception as e:\n"
        "        out[name] = f'missing ({type(e).__name__})'\n"
        "print(json.dumps(out))\n"
    )
    return {"cmd": [sys.executable, "-c", code], "json_stdout": True}


def demo_part(args: argparse.Namespace, work: Path) -> dict:
    small = "n_short=400, n_long=8, vocab_size=2048" if args.dry_run else ""
    code = f"from lit_hbp.demo.text import ensure_demo; ensure_demo({str(args.demo_dir)!r}, {small})"
    return {"cmd": [sys.executable, "-c", code]}


def tests_part(args: argparse.Namespace, work: Path) -> dict:
    """``pytest -m gpu`` over the test files that mark a test so (collecting the others imports them for nothing);
    a dry run over the first of them (the suite collects every one on a CPU: its GPU tests skip there)."""
    marked = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    marked = marked[:1] if args.dry_run else marked
    return {
        "cmd": [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", *marked],
        "pytest": True,
    }


def throughput_part(args: argparse.Namespace, work: Path) -> dict:
    out = work / "throughput.json"
    demo = f"--data.demo_dir={args.demo_dir}"
    if args.dry_run:
        # One timed step after one warm-up step a level; no accumulation, as the 1B config's: the hbp mode
        # trains the plan's mixed steps until each level had its two (a 1024 step is one in nine of them).
        config = ["--config", "configs/tiny_cpu.yaml", "--steps", "1", "--warmup", "1"]
        config += ["--modes", "hbp,hbp_alone,hf_sdpa,trl_bfd", "--data.levels=[256, 1024]"]  # packs enough of both
        config += ["--trainer.accumulate_grad_batches=1"]
    else:
        config = ["--config", "configs/llama_1b_1gpu.yaml", "--steps", "12", "--warmup", "4"]
        config += ["--modes", "hbp_alone,hf_sdpa,hf_flex_attention,hf_flash_attention_2"]  # each level alone
    config += [demo, f"--trainer.logger.init_args.save_dir={work / 'runs'}"]  # the config's logger, in the work folder
    return {"cmd": [sys.executable, str(HERE / "gpu_throughput.py"), *config, "--json", str(out)], "json": out}


def peers_part(args: argparse.Namespace, work: Path) -> dict:
    out = work / "peers.json"
    # --batch-size 2: 8 padded 8K rows of the 1B model's activations (not checkpointed) ran out of an H100's 80 GB
    size = ["--size", "tiny", "--samples", "12", "--long", "0", "--max-len", "1024"] if args.dry_run else [
        "--size", "1b", "--samples", "300", "--long", "4", "--max-len", "8192", "--batch-size", "2"
    ]  # fmt: skip
    cmd = [sys.executable, str(HERE / "peers.py"), *size, "--rounds", "1", "--demo-dir", str(args.demo_dir)]
    per_mode = int(BOXES["peers"] * getattr(args, "scale", 1.0)) // 2  # the part's box, half for one mode
    cmd += ["--work", str(work / "peers"), "--timeout", str(per_mode), "--json", str(out)]
    return {"cmd": cmd, "json": out}


def vlm_site(work: Path) -> str | None:
    """A folder with transformers >= 5.18 (vision-language packs need its ``mm_encoder_outputs``) for the
    parts with images, installed from .whl/vlm/ (bench/gpu_wheels.sh) where this Python's is older; None
    where it is new enough. Raises where it is older and .whl/vlm/ has no wheels."""
    import importlib.metadata

    from packaging.version import Version

    if Version(importlib.metadata.version("transformers")) >= Version("5.18"):
        return None
    wheels = sorted(str(w) for w in (ROOT / ".whl" / "vlm").glob("*.whl"))
    if not wheels:
        raise RuntimeError("transformers is older than 5.18 here and .whl/vlm/ is empty: run bench/gpu_wheels.sh")
    site = work / "vlm_site"
    if not site.exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
        subprocess.run([*pip, *wheels], check=True)
    return str(site)


def vlm_part(args: argparse.Namespace, work: Path) -> dict:
    """The tiny vision-language config on one GPU in bf16 (its demo built in the work folder)."""
    cmd = [sys.executable, "train.py", "fit", "--config", "configs/tiny_vlm_cpu.yaml"]
    if args.dry_run:
        cmd += ["--trainer.max_steps=2"]
    else:
        cmd += ["--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.precision=bf16-mixed"]
        cmd += ["--trainer.max_steps=60"]
    cmd += ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]"]
    cmd += [f"--data.demo_dir={work / 'demo_vlm'}", f"--data.cache_dir={work / 'vlm_cache'}"]
    site = None if args.dry_run else vlm_site(work)
    return {"cmd": cmd + [f"--trainer.default_root_dir={work}"], "images": True, "site": site}


def sp2_part(args: argparse.Namespace, work: Path) -> dict | str:
    """The 1B config with one level, 16K tokens at sp 2 (every step runs it), on every GPU here."""
    if args.gpus < 2:
        return f"skipped: {args.gpus} GPU(s), an sp 2 level needs 2"
    cmd = [sys.executable, "train.py", "fit", "--config", "configs/llama_1b_1gpu.yaml"]
    cmd += ["--data.levels=[{pack_len: 16384, sp: 2}]", f"--trainer.devices={args.gpus}", "--trainer.max_steps=20"]
    cmd += ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]"]
    cmd += [f"--data.demo_dir={args.demo_dir}", f"--trainer.default_root_dir={work}"]
    return {"cmd": cmd, "levels": True}


def level_steps(log: str) -> list[dict]:
    """The rows of the per-level table a fit prints at its end: level, pack_len, sp, steps, tokens/s."""
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+\d+\s+\d+\s+[\d.]+\s+(\d+)\s*$", log, re.M)
    return [dict(zip(("level", "pack_len", "sp", "steps", "tokens_per_s"), map(int, r))) for r in rows]


BUILDERS = {
    "env": env_part, "demo": demo_part, "tests": tests_part, "throughput": throughput_part, "peers": peers_part,
    "vlm": vlm_part, "sp2": sp2_part,
}  # fmt: skip


def pytest_counts(log: str) -> dict:
    """Passed / failed / skipped / errors from ``pytest -v`` lines (also when it was cut off)."""
    counts = {
        k: len(re.findall(rf"^\S+::\S+.* {k.upper()}", log, re.M)) for k in ("passed", "failed", "skipped", "error")
    }
    counts["failed_tests"] = re.findall(r"^(\S+::\S+)\S* FAILED", log, re.M)[:10]
    return counts


def run_part(name: str, spec: dict | str, box: float, logf) -> dict:
    if isinstance(spec, str):
        return {"status": spec}
    start = time.perf_counter()
    logf.write(f"\n===== {name}: {' '.join(map(str, spec['cmd']))}\n")
    logf.flush()
    path = os.pathsep.join(filter(None, [spec.get("site"), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    # its own process group: a part over its box is stopped with every process it started (peers' workers)
    proc = subprocess.Popen(
        spec["cmd"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=box)
        status = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"timed out after {box:.0f} s"
    logf.write(out + err)
    logf.flush()
    result: dict = {"status": status, "seconds": round(time.perf_counter() - start, 1)}
    if spec.get("json_stdout") and status == "passed":
        result["result"] = json.loads(out.strip().splitlines()[-1])
    if spec.get("json") and Path(spec["json"]).exists():
        result["result"] = json.loads(Path(spec["json"]).read_text())
    if spec.get("levels"):
        result["result"] = level_steps(out + err)
        if status == "passed" and not any(r["sp"] > 1 and r["steps"] for r in result["result"]):
            result["status"] = "failed: no step ran a level with sp > 1"
    if spec.get("images"):
        line = next((x for x in (out + err).splitlines() if x.startswith("self-check passed")), "")
        tower = next((x for x in (out + err).splitlines() if x.startswith("vision tower attention")), "")
        result["result"] = {"self_check": line, "tower": tower, "levels": level_steps(out + err)}
        if status == "passed" and "with images" not in line:
            result["status"] = "failed: the self-check ran no pack with images"
    if spec.get("pytest"):
        result["result"] = pytest_counts(out)
        if status.startswith("failed (exit 5)"):  # no test selected (none marked gpu): a finding, not a crash
            result["status"] = "failed: no test selected"
    if not status == "passed":
        result["tail"] = (out + err).strip().splitlines()[-5:]
    return result


def tables(report: dict) -> str:
    """The markdown of the proof: parts, throughput, memory, attention, peers."""
    lines = [f"# GPU proof: {report['device']} ({'dry run' if report['dry_run'] else 'full'})", ""]
    lines += ["| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {p['status']} | {p.get('seconds', '')} |" for n, p in report["parts"].items()]
    tests = report["parts"].get("tests", {}).get("result")
    if tests:
        lines += ["", f"pytest -m gpu: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped, "
                  f"{tests['error']} errors {' '.join(tests['failed_tests'])}"]  # fmt: skip
    thr = report["parts"].get("throughput", {}).get("result")
    if thr:
        lines += ["", f"## Throughput ({thr['config']}, {thr['parameters'] / 1e9:.2f}B parameters)", ""]
        lines += ["| level mode | tokens/s | MFU | vs hf_sdpa |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['tokens_per_s']} | {r['mfu']} | {r['vs_hf_sdpa']} |" for r in thr["throughput"]]
        lines += ["", "| level | predicted GiB (tensors) | max_memory_allocated GiB | error |", "|---|---|---|---|"]
        for m in thr["memory"]:
            measured = "" if m["measured_gib"] is None else f"{m['measured_gib']:.2f}"
            lines.append(f"| {m['name']} | {m['predicted_gib']:.2f} | {measured} | {m['error']} |")
        lines += ["", "| attention calls | backend | why | backward |", "|---|---|---|---|"]
        lines += [
            f"| {c['dtype']} {c['needs']} on {c['device']} | {c['backend']} | {c['why']} | {c['backward']} |"
            for c in thr["attention"]
        ]
    vlm = report["parts"].get("vlm", {}).get("result")
    if vlm:
        lines += ["", "## Vision-language (configs/tiny_vlm_cpu.yaml)", "", vlm["self_check"] or "no self-check"]
        lines += ["", vlm.get("tower") or "no tower attention logged"]
        lines += ["", "| level | pack_len | sp | steps | tokens/s |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['level']} | {r['pack_len']} | {r['sp']} | {r['steps']} | {r['tokens_per_s']} |"
            for r in vlm["levels"]
        ]
    peers = report["parts"].get("peers", {}).get("result")
    if peers:
        lines += ["", f"## Peers ({peers['data']['samples']} samples, {peers['data']['tokens']:,} tokens)", ""]
        lines += ["| mode | attention | seconds | tokens/s | time vs lit-hbp | padding | check max diff | apart |"]
        lines += ["|---|---|---|---|---|---|---|---|"]
        for mode, r in peers["modes"].items():
            if "median_s" not in r:
                lines.append(f"| {mode} | failed: {'; '.join(r['errors'])} | | | | | | |")
                continue
            diff, vs = r.get("check_max_diff"), r.get("vs_lit_hbp")
            lines.append(
                f"| {mode} | {r['attention']} | {r['median_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                f"{'' if vs is None else f'{vs:.2f}x'} | {r['padding']:.3f} | "
                f"{'' if diff is None else f'{diff:.1e}'} | "
                f"{ {True: 'yes', False: 'NO', None: ''}[r.get('apart')] } |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU: the tiny config, a few steps, the same parts")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_proof"))
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--work", default=str(ROOT / "runs" / "gpu_proof_work"), help="models, data and the parts' outputs")
    p.add_argument("--demo-dir", help="the demo data (default: demo_data, or a small one in --out's work folder)")
    p.add_argument("--box-scale", type=float, default=1.0, help="multiply every part's time box")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()  # models, data, part outputs: kept out of --out (8 files come back)
    work.mkdir(parents=True, exist_ok=True)
    args.demo_dir = Path(args.demo_dir or (work / "demo" if args.dry_run else ROOT / "demo_data")).resolve()
    gpus = subprocess.run(
        [sys.executable, "-c", "import gc; gc.disable(); import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    args.gpus = int(gpus) if gpus.isdigit() else 0
    if args.gpus == 0 and not args.dry_run:
        print("gpu_proof: no CUDA GPU here; --dry-run runs the same parts on a CPU", file=sys.stderr)
        return 2
    # A dry run's boxes only bound a hang: a loaded 2-core CPU builds and trains many times slower.
    scale = args.box_scale * (10.0 if args.dry_run else 1.0)
    args.scale = scale
    report = {"device": "cpu" if args.dry_run and args.gpus == 0 else f"{args.gpus} GPU(s)", "dry_run": args.dry_run}
    report["host"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    report["parts"] = {}
    started = time.perf_counter()
    with open(out / "proof.log", "w") as logf:
        for name in parts:
            try:
                spec = BUILDERS[name](args, work)
            except (RuntimeError, subprocess.CalledProcessError) as e:  # a part that cannot start here
                spec = f"failed: {e}"
            result = run_part(name, spec, BOXES[name] * scale, logf)
            report["parts"][name] = result
            print(f"gpu_proof: {name}: {result['status']} ({result.get('seconds', 0)} s)", flush=True)
            if name == "env" and "result" in result and result["result"]["gpus"]:
                report["device"] = ", ".join(result["result"]["gpus"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "proof.json").write_text(json.dumps(report, indent=1))
    md = tables(report)
    (out / "proof.md").write_text(md)
    print(md)
    print(f"gpu_proof: {report['seconds']} s; {out / 'proof.json'}, {out / 'proof.md'}, {out / 'proof.log'}")
    ran = [r for r in report["parts"].values() if not r["status"].startswith("skipped")]
    return 0 if all(r["status"] == "passed" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
