"""The worker process of `exgrpo_pl.rewards.worker.WorkerProcess`: runs the calls it is sent until killed.

Started as a script, `python -I _worker_main.py FD PARENT_PID` (isolated mode keeps this directory, which has
a `math_verify.py` of its own, off `sys.path`). It imports the standard library only, so it starts in tens of
milliseconds; what a call needs (a reward function's module, math-verify) is imported when the call
arrives, and stays imported for the next one.

Protocol over the connection on file descriptor FD: the parent sends its `sys.path`, the worker answers
"ready"; then it answers each `(function, args, kwargs)` with `("ok", value)`, `("raised", (exception,
traceback))` (exception None when it cannot be pickled), or `("unloadable", traceback)` when the request
could not be unpickled here (a function of a module this process cannot import, say), until the connection
closes. `function` is a callable (sent with cloudpickle: by reference, or by value when the parent's
`__main__` defines it), or a `(path, name)` pair: the function `name` of
the stdlib-only file at `path`, loaded without importing the package around it (whose `__init__` imports
torch, seconds at every start).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1
_loaded_files: dict[str, object] = {}


def _die_with_parent(parent_pid: int) -> None:
    """Asks Linux to SIGKILL this process when its parent dies, so a call stuck in C code (a backtracking
    regex) does not outlive a trainer that was itself killed with SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _resolve(function):
    if not isinstance(function, tuple):
        return function
    path, name = function
    if path not in _loaded_files:
        spec = importlib.util.spec_from_file_location(f"_worker_file_{len(_loaded_files)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded_files[path] = module
    return getattr(_loaded_files[path], name)


def _picklable(err: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return None
    return err


def serve(connection: Connection) -> None:
    """Answers calls until the parent closes the connection (or kills this process)."""
    # Ctrl-C goes to the whole process group: the parent handles it and stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = connection.recv()
    connection.send("ready")
    while True:
        try:
            function, args, kwargs = connection.recv()
        except EOFError:
            return
        except Exception:
            connection.send(("unloadable", traceback.format_exc()))
            continue
        try:
            reply = ("ok", _resolve(function)(*args, **kwargs))
        except Exception as err:
            reply = ("raised", (_picklable(err), traceback.format_exc()))
        try:
            connection.send(reply)
        except Exception as err:  # a return value that cannot be pickled
            connection.send(("raised", (_picklable(err), traceback.format_exc())))


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    serve(Connection(int(sys.argv[1])))
