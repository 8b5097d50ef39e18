"""Run a command and report its memory high-water marks (Linux /proc):

    python bench/peak_rss.py [--interval 0.5] [--json out.json] -- python -m dsrl.main ...

- root_hwm_mib: the command's own process (the trainer under `python -m dsrl.main`): VmHWM from
  /proc/<pid>/status, the kernel's exact peak RSS of that process.
- tree_rss_mib / tree_pss_mib: the largest SUM over the process tree (the command and every
  descendant: vLLM engine cores, compile workers ...) seen at one sample. Sampled every --interval
  seconds, so a peak shorter than that can be missed. RSS counts a page mapped by two processes (the
  shared-memory weight sync, shared libraries) twice; PSS splits it between them, so tree PSS is the
  better estimate of what the whole job holds.
- per_process_hwm_mib: VmHWM of each process seen (exact per process), by pid and command line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


def _proc_kib(pid: int, name: str, field: str) -> int:
    """The kiB figure of `field` ("VmHWM:", "Pss:") in /proc/<pid>/<name>; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/{name}") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:  # the process exited between the listing and the read
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = root_hwm = 0
    seen: dict[int, dict] = {}
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        rss = pss = 0
        for p in procs:
            try:
                r = p.memory_info().rss
                name = " ".join(p.cmdline())[:120]
            except psutil.Error:
                continue
            rss += r
            pss += _proc_kib(p.pid, "smaps_rollup", "Pss:") * 1024
            hwm = _proc_kib(p.pid, "status", "VmHWM:")
            if hwm:
                seen.setdefault(p.pid, {"cmd": name, "hwm_kib": 0})
                seen[p.pid]["hwm_kib"] = max(seen[p.pid]["hwm_kib"], hwm)
        root_hwm = max(root_hwm, _proc_kib(proc.pid, "status", "VmHWM:"))
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(args.interval)
    rc = proc.wait()
    out = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1),
           "root_hwm_mib": round(root_hwm / 1024), "tree_rss_mib": round(peak_rss / 2**20),
           "tree_pss_mib": round(peak_pss / 2**20),
           "per_process_hwm_mib": {str(pid): {"cmd": v["cmd"], "hwm_mib": round(v["hwm_kib"] / 1024)}
                                   for pid, v in seen.items() if v["hwm_kib"] > 50 * 1024}}
    text = json.dumps(out, indent=1)
    print("peak_rss:", text, file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
