"""A real Prometheus server (Debian's `prometheus`) for tests: scrapes given loopback targets every
second, evaluates the given rule files every second, and answers PromQL over its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pdserve.runtime.redis_server import free_port


class PrometheusServer:
    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path] = (), job: str = "pdserve") -> None:
        self.workdir, self.port = workdir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen | None = None
        self._log = workdir / "prometheus.log"

    @staticmethod
    def available() -> bool:
        return shutil.which("prometheus") is not None and shutil.which("promtool") is not None

    def start(self, timeout: float = 30) -> PrometheusServer:
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=open(self._log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready in {timeout}s:\n{self.log()[-3000:]}"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or a scalar as one sample) `expr` gives now."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def target_health(self) -> list[str]:
        return [t["health"] for t in self.api("targets")["activeTargets"]]

    def alert_states(self) -> dict[str, str]:
        """alertname -> the most advanced state among its alerts (firing > pending)."""
        states: dict[str, str] = {}
        for alert in self.api("alerts")["alerts"]:
            name = alert["labels"]["alertname"]
            if states.get(name) != "firing":
                states[name] = alert["state"]
        return states

    def wait_for(self, predicate, what: str, timeout: float, interval: float = 0.25):
        deadline = time.monotonic() + timeout
        while not (result := predicate()):
            assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
            time.sleep(interval)
        return result
