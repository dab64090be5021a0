"""A live `python -m launch.server` subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def role_processes(pid: int) -> list:
    """A launcher's role processes (scheduler ranks, DP controller, detokenizer) in start order:
    its spawned children, or under `server.start_method=forkserver` (the default) the children of
    its fork server. multiprocessing's resource tracker is neither."""
    import psutil

    out = []
    for p in psutil.Process(pid).children():
        cmd = " ".join(p.cmdline())
        if "spawn_main" in cmd:
            out.append(p)
        elif "forkserver" in cmd:
            out.extend(p.children())
    return sorted(out, key=lambda p: p.pid)


def still_running(procs: list, timeout: float = 15.0) -> list:
    """The processes of `procs` not dead within `timeout` s. A zombie is dead (no memory, no GPU):
    reaping it falls to its parent, or once that died to init or a subreaper (a CI runner, a
    timing harness), which may not be prompt."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


class LiveServer:
    """One server subprocess; its combined output goes to a log file shown on failures. `env`:
    extra environment variables of the server (e.g. MOESERVE_* test hooks)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="moeserve-e2e-", suffix=".log",
                                               delete=False)
        self.run_dir = tempfile.mkdtemp(prefix="moeserve-run-")  # Hydra's run dir: config + log
        cmd = [sys.executable, "-m", "launch.server", f"server.port={self.port}",
               f"hydra.run.dir={self.run_dir}", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> LiveServer:
        deadline = time.monotonic() + timeout
        # one client for every probe: httpx.get builds a client, and its SSL context, per call
        # (~20 ms of a core; at 10 probes a second, a fifth of a core while a server starts)
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)  # a probe costs ~0.2 ms; each 0.5 s poll left ~0.25 s idle a start
        self.stop()
        pytest.fail(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0, keep_log: bool = False) -> int:
        """SIGTERM (SIGKILL after `timeout`); the log file is deleted unless `keep_log`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if keep_log:
            print(f"server log kept at {self.log.name}")
        elif os.path.exists(self.log.name):
            os.unlink(self.log.name)
        return self.proc.returncode


def assert_concurrent_chats_match_engine(url: str, model_path: str, questions: list[str],
                                         lens: list[int], engine_overrides: list[str],
                                         engine=None) -> None:
    """len(lens) concurrent greedy chat requests through the official openai client produce the
    same text and token counts as the single-process Engine on the same chat prompts (`engine`:
    one already running, else one is started on model_path with engine_overrides)."""
    import contextlib

    from moeserve import Engine

    answers = concurrent_chats(url, questions, lens)
    with (contextlib.nullcontext(engine) if engine is not None
          else Engine(model_path, engine_overrides)) as eng:
        expected = engine_chat_texts(eng, questions, lens)
    assert_chats_equal(answers, lens, expected)


def concurrent_chats(url: str, questions: list[str], lens: list[int]) -> list:
    """len(lens) concurrent greedy chats (questions[i], at most and at least lens[i] tokens)
    through the official openai client; -> its ChatCompletions."""
    import concurrent.futures as cf

    import openai

    client = openai.OpenAI(api_key="unused", base_url=url + "/v1", timeout=120, max_retries=0)
    model = client.models.list().data[0].id

    def ask(i: int):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": questions[i]}], temperature=0,
            max_tokens=lens[i], extra_body={"ignore_eos": True})

    with cf.ThreadPoolExecutor(len(lens)) as pool:
        return list(pool.map(ask, range(len(lens))))


def engine_chat_texts(eng, questions: list[str], lens: list[int]) -> list[str]:
    """An Engine's greedy texts for the same chats (the reference of `concurrent_chats`)."""
    chats = [eng.apply_chat_template([{"role": "user", "content": q}])
             for q in questions[: len(lens)]]
    return [e["text"] for e in eng.generate(input_ids=chats, sampling_params=[
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": n} for n in lens])]


def assert_chats_equal(answers: list, lens: list[int], texts: list[str]) -> None:
    assert [a.usage.completion_tokens for a in answers] == lens
    assert [a.choices[0].message.content for a in answers] == texts


def post_in_background(url: str, timeout: float) -> tuple[threading.Thread, list]:
    """POST `url` (no body) on a started daemon thread. The list receives its response or its
    httpx.HTTPError: for tests that kill a process while the request is in flight."""
    reply: list = []

    def post() -> None:
        try:
            reply.append(httpx.post(url, timeout=timeout))
        except httpx.HTTPError as e:
            reply.append(e)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, reply

