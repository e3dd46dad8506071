"""`keep_job_logs`: what a run that missed its target leaves beside the report, from a cloud's data dir laid out as
the local cloud lays it out (node logs per host and job, agents' and controllers' logs under `logs/`)."""

from __future__ import annotations

from pathlib import Path

from harmonaize_cli.evaluation.runtime.kept_logs import keep_job_logs, tail


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_the_jobs_node_logs_its_controller_and_the_agents_are_kept_and_nothing_else(tmp_path: Path) -> None:
    data, out = tmp_path / "cloud", tmp_path / "out"
    for host in ("h1", "h2"):
        _write(data / "hosts" / host / "jobs" / "demo.train" / "node-e1.log", f"step=1 on {host}\n".encode())
        _write(data / "hosts" / host / "jobs" / "demo.other" / "node-e1.log", b"another job\n")
        _write(data / "logs" / f"agent-{host}.log", f"agent {host}\n".encode())
    _write(data / "logs" / "controller-train.log", b"scaler\n")
    _write(data / "logs" / "controller-other.log", b"not this one\n")
    _write(data / "logs" / "fleet-monitor.log", b"monitor\n")

    kept = keep_job_logs(data, out, tenant="demo", job="train")

    assert kept == out / "logs" / "train"
    assert sorted(p.name for p in kept.iterdir()) == [
        "agent-h1.log", "agent-h2.log", "controller-train.log", "fleet-monitor.log", "h1-node-e1.log",
        "h2-node-e1.log"]
    assert (kept / "h2-node-e1.log").read_text() == "step=1 on h2\n"


def test_a_long_log_keeps_its_end_from_a_line_start(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_bytes(b"".join(f"line {n:06d}\n".encode() for n in range(100_000)))  # 1.2 MB
    end = tail(log, max_bytes=1000)
    assert len(end) <= 1000 and end.startswith(b"line ") and end.endswith(b"line 099999\n")
    assert tail(log, max_bytes=10 << 20) == log.read_bytes()


def test_a_job_that_wrote_nothing_leaves_no_directory(tmp_path: Path) -> None:
    kept = keep_job_logs(tmp_path / "cloud", tmp_path / "out", tenant="demo", job="never")
    assert not kept.exists()
