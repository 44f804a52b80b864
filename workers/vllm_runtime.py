"""What a vLLM engine needs on an actor, whatever it serves (the target: `workers.engines.vllm`; a reward model:
`workers.scoring.vllm_reward`): the check that vLLM imports, the modules its start-up scan trips on, and the thread
that builds an engine and then runs every call on it (vLLM's CPU worker sets the OpenMP threads of the thread that
builds it, and its attention kernels check that the thread that runs them has as many).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
CPU_BLOCK_SIZE = 32  # CPU attention needs a multiple of 32; vLLM's CPU default (128) shares no prefix under 128 tokens


def vllm_import_problem() -> str | None:
    """Why vLLM cannot be imported here, or None."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure is reported with its message
        return f"{type(err).__name__}: {err}"
    return None


def cpu_head_size_problem(config, field: str) -> str | None:
    """Why vLLM's CPU attention cannot run a model of this config (its head size), or None."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    c = config.get_text_config()
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head in sizes:
        return None
    return (f"{field}: head size {head}, which vLLM's CPU attention does not run (it runs "
            f"{', '.join(map(str, sizes))}); use engine 'hf' on a CPU")


def unscannable_modules() -> list[str]:
    """Names of loaded modules holding a value that raises on `hasattr(value, "__dict__")` with an error other
    than AttributeError, e.g. an unbound werkzeug LocalProxy (`flask.request`, imported by moto's server): vLLM's
    CPU worker scans every module's namespace that way at start-up (`triton_utils.dispatcher._rebind_kernels`)
    and fails on them ("Working outside of application context")."""
    out = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for value in list(namespace.values()):
            try:
                hasattr(value, "__dict__")
            except Exception:  # noqa: BLE001 - what vLLM's scan would trip on
                out.append(name)
                break
    return out


@contextlib.contextmanager
def modules_hidden(names: list[str]):
    """Take modules out of sys.modules for the duration (vLLM's start-up scan), and put them back."""
    held = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(held)


class EngineThread:
    """A thread that builds the vLLM engine (`build()`) and then runs every function given to `submit`, in order."""

    def __init__(self, build: Callable, name: str = "winnow-vllm-engine"):
        self.engine = None
        self.failed: BaseException | None = None
        self.queue: queue.Queue = queue.Queue()
        self.started = threading.Event()
        threading.Thread(target=self._main, args=(build,), name=name, daemon=True).start()
        self.started.wait()
        if self.failed is not None:
            raise self.failed

    def _main(self, build: Callable) -> None:
        try:
            self.engine = build()
        except BaseException as err:  # noqa: BLE001 - raised in the constructor's thread
            self.failed = err
            self.started.set()
            return
        self.started.set()
        while True:
            self.queue.get()()

    def submit(self, fn: Callable[[], None]) -> None:
        self.queue.put(fn)

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run in the engine's thread, its result or its error here."""
        done = threading.Event()
        box: list = []

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
                box.append((False, err))
            done.set()

        self.queue.put(run)
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value
