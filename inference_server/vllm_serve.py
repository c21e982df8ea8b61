"""`python -m inference_server.vllm_serve --parent-pid PID <vllm serve flags>`: vLLM's OpenAI API server,
unmodified, in a process that dies with the one that started it, as Riptide's own servers do
(process.watch_parent). It runs in a session of its own, so the whole group goes: vLLM's engine
core and its workers with it. `process.VllmProcess` starts it."""
from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time


def watch_group(pid: int) -> None:
    def run() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.killpg(os.getpgid(0), signal.SIGKILL)
                return
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--parent-pid"]:
        watch_group(int(argv[1]))
        argv = argv[2:]
    sys.argv = ["vllm serve", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
