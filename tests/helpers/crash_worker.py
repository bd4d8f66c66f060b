"""Misbehaves on purpose so the tests can check the harness: `segv`, `abort` or `hang`."""

import os
import signal
import sys
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    print(f"crash_worker: {mode}", flush=True)
    if mode == "hang":
        time.sleep(600)
    os.kill(os.getpid(), signal.SIGSEGV if mode == "segv" else signal.SIGABRT)
