"""Warm start: a local train job runs in a process forked from one that has already imported the stack.

Why: a train job is a fresh Python process, and importing torch, transformers and ftbench is a large
part of a short run. Fresh processes on the H100 lent to this project took 2.4-7.3 s for ``import torch``
and 10.8-18.7 s for torch + transformers + a Llama class (on a 2-core laptop 1.4 s and 4.8 s), against
about 7 s of measured steps in a 60-step run of the 134M example. A sweep of short runs would be mostly
imports. (Numbers: README, "Warm start".)

How: a local workflow starts the warm process when it starts and waits until it has imported everything it will
(``python -m ftbench.cluster.warmstart start --wait`` from rules/common.smk), so the stack's one import is the
workflow's start-up, not the first train job's wall time; a train job that finds none starts one and runs inline as
before; a job that finds one still importing waits for it. The warm process imports the stack once (never
touching CUDA: a process that has initialised CUDA cannot fork a working CUDA child), listens on a Unix
socket, and for each later job forks a child that takes over the job's command line, environment,
working directory and standard streams (passed as file descriptors), runs it, and exits with the job's
exit status, which goes back to the job's own process (the "client": what Snakemake started). The
client forwards signals to the child, and the child ends if the client disappears (lifeline.py), so
Snakemake's stopping a job works as before. The warm process exits after ``FTBENCH_WARM_IDLE_S``
seconds (default 120) without a job.

Whether two jobs may share a warm process is decided by a key: the Python executable, sys.path (with
the mtimes of its site-packages folders, which change when packages are installed), ftbench's own files, the working
directory and the environment, less the variables that are read only when a job runs or that the forked
job applies itself (``CUDA_VISIBLE_DEVICES``, ``FTBENCH_*``, and the thread and temp-folder variables
Snakemake sets per job). A change to any of them starts a new warm process; a stale one just idles out.

Not used: under SLURM (each job is its own allocation; nothing would be shared), for DDP ranks (torchrun
starts them), off Linux, or with ``FTBENCH_WARM_START=0``. A job forked this way records
``warm_start: true``, and its ``overhead_s`` counts from the start of its client process.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from ftbench.cluster import lifeline
from ftbench.measure import environment

# torch is imported only inside the warm process's own functions (serve and its fork checks): the client
# side runs in every train job and at Snakemake parse time, and must stay light and torch-free.

IDLE_S = 120.0
CONNECT_TIMEOUT_S = 10.0  # from connecting to the child's pid: the warm process only accepts and forks
# How long a job waits for a warm process that is still importing (it was started before the job, so it
# is ready sooner than the job would be after importing the same modules itself).
READY_WAIT_S = 60.0

# Read when a job runs, or applied by the forked job itself (_become_job): jobs differing only in these
# may share a warm process. Snakemake sets the thread and temp-folder variables per job (its threads and
# tmpdir), which the workflow does not know when it starts the warm process.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
PER_JOB_VARIABLES = {"PWD", "OLDPWD", "SHLVL", "_", "PS1", "CUDA_VISIBLE_DEVICES", "TMPDIR", "TEMP", "TMP", "TEMPDIR",
                     *THREAD_VARIABLES}
PER_JOB_PREFIXES = ("FTBENCH_",)

# What the warm process imports: what every train job needs. transformers loads lazily: its Auto classes
# pull in generation (and with it scikit-learn and scipy, 2.2 s of a warm job on the H100 before they
# were listed here); an architecture's own module is small (0.4 s for Llama) and left to the job.
PRELOAD = (
    "torch", "numpy", "pandas", "pyarrow.parquet", "psutil", "threadpoolctl",
    "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
    "transformers.generation.utils", "transformers.modeling_layers", "transformers.processing_utils",
    "ftbench.cli", "ftbench.train.job", "ftbench.train.trainer", "ftbench.train.modeling", "ftbench.train.evaluation", "ftbench.data.images",
)
# Preloaded only where importing them leaves CUDA alone (tried first in a forked child). torch._dynamo and
# torch._inductor.compile_fx are what torch.compile imports, and what bitsandbytes imports (through peft): most
# of a LoRA job's 3.9 s more than a full one's before its first step on an H100. Imported plainly they
# initialised the CUDA driver there (asking torch.cuda.is_available() does), so the warm process asks NVML
# instead (NVML_CUDA_CHECK). peft: with a CUDA build of bitsandbytes installed, importing peft imports it, and
# it initialises CUDA to pick its library; then jobs import it.
PRELOAD_IF_FORK_SAFE = ("torch._dynamo", "torch._inductor.compile_fx", "peft")
# torch's switch for answering torch.cuda.is_available() from NVML, which does not initialise the CUDA driver
# in the asking process (a forked child of it can then still use the GPU). Set in the warm process only: a
# job's environment is its own.
NVML_CUDA_CHECK = ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Signals the client passes on to the job it stands for (SIGTERM: stop and save; SIGUSR1: dump stacks).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

# The commands that import the training stack: a train job, and the evaluation before training shared by the runs
# of one base model (started cold, each paid ~6 s of imports on 2 cores; the default experiment has two).
WARM_COMMANDS = ("train", "base-eval")


def wanted(argv: list[str], environ=os.environ) -> bool:
    """Whether this command should run warm: a train job (not a DDP rank) or a shared evaluation before training,
    locally, on Linux."""
    return (bool(argv) and argv[0] in WARM_COMMANDS and "--rank-dir" not in argv and environment.job_started_at is None
            and environ.get("FTBENCH_WARM_START", "1").lower() not in ("0", "false", "no", "off")
            and not environ.get("SLURM_JOB_ID") and sys.platform.startswith("linux") and hasattr(socket, "send_fds"))


def runtime_dir() -> Path | None:
    """A folder only this user can write: where the warm processes' sockets live. None if there is none."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "ftbench" if base and os.path.isdir(base) else Path(tempfile.gettempdir()) / f"ftbench-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.stat()
    except OSError:
        return None
    # Another user's folder (or a world-writable one) could hold a socket that would run our jobs.
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return folder


def server_key(environ=os.environ) -> str:
    digest = hashlib.sha256()
    digest.update(f"{sys.executable}\0{sys.version}\0{os.getcwd()}\0".encode())
    for entry in sys.path:
        digest.update(f"{entry}\0".encode())
        if entry.endswith(("site-packages", "dist-packages")):
            # Installing or upgrading a package changes its folder (a new dist-info); the working
            # directory, also on sys.path, changes with every result written, so it is left out.
            with contextlib.suppress(OSError):
                digest.update(f"{os.stat(entry).st_mtime_ns}\0".encode())
    package = Path(__file__).resolve().parents[1]  # the whole ftbench package, not only cluster/
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    for name, value in sorted(environ.items()):
        if name not in PER_JOB_VARIABLES and not name.startswith(PER_JOB_PREFIXES):
            digest.update(f"{name}={value}\0".encode())
    return digest.hexdigest()[:24]


def socket_path(environ=os.environ) -> Path | None:
    folder = runtime_dir()
    return None if folder is None else folder / f"{server_key(environ)}.sock"


# --- the client: the job's own process ------------------------------------------------------------

def run_warm(argv: list[str]) -> int | None:
    """Run ``python -m ftbench <argv>`` in a child of the warm process; its exit status, or None when
    there is no warm process to use (the caller then runs the command itself; one is started for the
    next job)."""
    path = socket_path()
    if path is None:
        return None
    asked = time.monotonic()
    connection = _connect(path)
    ready_wait_s = time.monotonic() - asked  # the workflow's warm process still importing, when the job came early
    if connection is None:
        start_server(path)
        return None
    with connection:
        connection.settimeout(CONNECT_TIMEOUT_S)
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
                              "client_pid": os.getpid(), "client_started": _process_start_time(),
                              "ready_wait_s": ready_wait_s}).encode()
        try:
            socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
            reader = connection.makefile("r", encoding="utf-8")
            child = int(_expect(reader.readline(), "pid"))
        except (OSError, ValueError):
            return None  # the warm process ended before forking (idle exit): run inline
        connection.settimeout(None)
        previous = {number: signal.signal(number, lambda number, _frame: _forward(child, number)) for number in FORWARDED_SIGNALS}
        try:
            line = reader.readline()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    if line.startswith("exit "):
        return int(line.split()[1])
    # The warm process itself ended during the job (killed): the job lives on without it. Wait for it.

    while lifeline.alive(child):
        time.sleep(0.5)
    print(f"ftbench: the warm-start process ended during this job (pid {child}); its exit status is unknown",
          file=sys.stderr, flush=True)
    return 1


def _connect(path: Path) -> socket.socket | None:
    """A connection to the warm process at ``path``; while one holds its lock but does not listen yet
    (importing), wait for it, up to READY_WAIT_S. None if there is none to use."""
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _address(path) as address:
                connection.connect(address)
            return connection
        except OSError:
            connection.close()
        if time.monotonic() > deadline or not _serving(path):
            return None
        time.sleep(0.1)


def start_server(path: Path) -> None:
    """Start a warm process in the background, in its own session (so stopping this job's process group
    leaves it alone); it exits by itself when idle. Not where one for this key failed before: it would
    fail again (its reason is in the .failed file)."""
    if path.with_suffix(".failed").exists() or _serving(path):
        return

    log = open(path.with_suffix(".log"), "ab")  # noqa: SIM115 - handed to the child, closed here after
    with log:
        subprocess.Popen([sys.executable, "-m", "ftbench.cluster.warmstart", "serve", str(path)], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


@contextlib.contextmanager
def _address(path: Path):
    """An address for ``path`` that fits the 108 bytes a Unix socket's name may have: through this process's
    open handle on its folder (``/proc/self/fd/N/name``) when the full path is longer."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def start_ahead(wait: bool = False) -> None:
    """Start the warm process that a train job started here would use, unless one runs (or is importing):
    the workflow does this when it starts (rules/common.smk). With ``wait``, return once it has imported all it
    will (up to READY_WAIT_S): the workflow starts its first train job only then, so that job's wall time is its
    own (it waited 6-15 s inside it on H100 hosts before November 2026). Nothing where train jobs would not run
    warm."""
    path = socket_path() if wanted(["train"]) else None
    if path is None:
        return
    start_server(path)
    if not wait:
        return
    started = time.monotonic()
    ready = wait_until_ready(path)
    waited = time.monotonic() - started
    if ready:
        print(f"ftbench: warm start: train jobs fork from a process that had the stack imported {waited:.1f} s after "
              "the workflow started it", file=sys.stderr, flush=True)
    else:
        print(f"ftbench: warm start: the warm process was not ready after {waited:.0f} s (its log: {path.with_suffix('.log')});"
              " train jobs wait for it or run on their own", file=sys.stderr, flush=True)


def wait_until_ready(path: Path, timeout_s: float = READY_WAIT_S, start_grace_s: float = 10.0) -> bool:
    """Whether the warm process of ``path`` became ready (listening, its optional imports settled: its ``.ready``
    file names it) within ``timeout_s``. False at once when it gave up (``.failed``) or ended, and when none holds
    the lock ``start_grace_s`` after the call (one just started takes it within its first second)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if path.with_suffix(".failed").exists():
            return False
        if _serving(path):
            if _ready_pid(path) is not None and _ready_pid(path) == _lock_pid(path):
                return True
        elif time.monotonic() - started > start_grace_s:
            return False
        time.sleep(0.1)
    return False


def _ready_pid(path: Path) -> int | None:
    """The pid in ``path``'s ``.ready`` file (written by a warm process once it has imported all it will)."""
    try:
        return int(path.with_suffix(".ready").read_text().strip())
    except (OSError, ValueError):
        return None


def _lock_pid(path: Path) -> int | None:
    try:
        return int(path.with_suffix(".lock").read_text().strip())
    except (OSError, ValueError):
        return None


def _mark_ready(path: Path) -> None:
    """Say that this warm process has imported all it will (``wait_until_ready`` reads it): its pid, so a file
    left by one that was killed is not taken for the next one's."""
    temporary = path.with_suffix(".ready.tmp")
    temporary.write_text(str(os.getpid()), encoding="utf-8")
    temporary.replace(path.with_suffix(".ready"))


def _serving(path: Path) -> bool:
    """Whether a warm process holds ``path``'s lock (serving, or still importing)."""
    try:
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def _forward(child: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, number)


def _expect(line: str, word: str) -> str:
    if not line.startswith(word + " "):
        raise ValueError(f"expected {word!r} from the warm process, got {line!r}")
    return line.split()[1]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _process_start_time() -> float:
    """When this process started (the operating system's record, on the boot clock the forked job reads its age
    with: environment.process_age_s), so a warm job's overhead counts the client's own start-up too."""
    started = environment.process_started_s()
    return time.clock_gettime(time.CLOCK_BOOTTIME) if started is None else started


# --- the warm process ------------------------------------------------------------------------------

def serve(path: Path, idle_s: float | None = None) -> int:
    """Import the stack, then fork a child per connecting job until idle for ``idle_s``. Returns an exit
    status (0 also when another warm process already serves ``path``)."""
    idle_s = float(os.environ.get("FTBENCH_WARM_IDLE_S", IDLE_S)) if idle_s is None else idle_s
    lock = _take_lock(path)  # held for the process's life
    if lock is None:
        return 0  # two jobs started one each at once: the other one serves
    with contextlib.suppress(FileNotFoundError):
        path.with_suffix(".ready").unlink()  # a killed predecessor's
    started = time.perf_counter()
    reason, optional = _preload()
    if reason:
        return _give_up(path, reason)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop_server: clean up the socket on the way out
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        with _address(path) as address:
            listener.bind(address)
    except OSError as exc:
        return _give_up(path, f"cannot listen at {path}: {exc}")
    os.chmod(path, 0o600)
    listener.listen(64)
    print(f"warm start: pid {os.getpid()} ready in {time.perf_counter() - started:.1f} s at {path}", flush=True)
    try:
        _fork_jobs(listener, idle_s, optional, lambda: _mark_ready(path))
    finally:
        listener.close()  # from here a connecting client is refused and runs inline
        for leftover in (path, path.with_suffix(".ready")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    print(f"warm start: idle for {idle_s:.0f} s; exiting", flush=True)
    return 0


def _take_lock(path: Path):
    """The lock file of ``path``, locked and holding this pid; None when another process holds it."""
    lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def _preload():
    """Import what every job needs (PRELOAD); (why forked jobs could not use the GPU afterwards, or None; the
    OptionalImports that check and import PRELOAD_IF_FORK_SAFE later)."""
    # The libraries' idle pool threads (OpenBLAS, jemalloc) have fork handlers, as in a DataLoader worker.
    warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
    os.environ[NVML_CUDA_CHECK[0]] = NVML_CUDA_CHECK[1]
    started = time.perf_counter()
    import torch  # deferred on purpose: importing it is this process's job, not its importers'

    gpu_visible = _in_forked_child(_sees_gpu)  # asked before anything else is imported
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"warm start: {name} not preloaded ({exc})", flush=True)
    print(f"warm start: imports took {time.perf_counter() - started:.1f} s", flush=True)
    reason = _why_not_fork_safe(torch.cuda.is_initialized(), gpu_visible, gpu_visible and _forked_child_can_use_gpu())
    # Whether each optional module imports leaving CUDA alone, asked of children forked now, with everything
    # above imported: what holds in such a child holds in this process after the same import.
    probes = {} if reason else {name: _fork_check(_imports_leaving_cuda_alone(name, gpu_visible)) for name in PRELOAD_IF_FORK_SAFE}
    return reason, OptionalImports(probes)


class OptionalImports:
    """PRELOAD_IF_FORK_SAFE, imported by the warm process where its probe child found that importing leaves CUDA
    alone. Polled from the accept loop while no job is asking, never waited on by a job that asks: it is forked
    between two modules' imports. A workflow waits for them before its first train job (start_ahead)."""

    DEADLINE_S = 120.0  # a probe still running after this is stopped and its module left to the jobs

    def __init__(self, probes: dict[str, int]):
        self.pending = dict(probes)  # module name -> the probe child's pid
        self.passed: list[str] = []
        self.started = time.monotonic()

    def poll(self) -> bool:
        """Collect the probes that have answered; once all have (or the deadline passed), import the modules
        that passed and return True. False while a probe is still running."""
        for name, pid in list(self.pending.items()):
            answer = _check_result(pid, block=False)
            if answer is not None:
                del self.pending[name]
                if answer:
                    self.passed.append(name)
                else:
                    print(f"warm start: {name} not preloaded: importing it initialises CUDA (or fails); jobs import it", flush=True)
        if self.pending and time.monotonic() - self.started < self.DEADLINE_S:
            return False
        for name, pid in self.pending.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            print(f"warm start: {name} not preloaded: its check took over {self.DEADLINE_S:.0f} s", flush=True)
        started = time.perf_counter()
        for name in self.passed:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a job imports it itself; serving goes on
                print(f"warm start: {name} not preloaded ({type(exc).__name__}: {exc})", flush=True)
        print(f"warm start: the optional imports took {time.perf_counter() - started:.1f} s", flush=True)
        return True


def _fork_jobs(listener: socket.socket, idle_s: float, optional: OptionalImports | None = None, on_ready=lambda: None) -> None:
    """Accept jobs and fork a child for each until no child has run for ``idle_s``; while no job is asking, the
    ``optional`` imports, then ``on_ready()`` (at once when there are none)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes select() through wake_read
    children: dict[int, socket.socket] = {}
    idle_since = time.monotonic()
    if optional is None:
        on_ready()
    while True:
        _reap(children)
        if children:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > idle_s:
            return
        # While the optional imports settle, their probes are polled often: the workflow waits for them.
        ready, _, _ = select.select([listener, wake_read], [], [], 1.0 if optional is None else 0.1)
        if wake_read in ready:
            os.read(wake_read, 4096)
        if listener in ready:
            _start_job(listener, children, (wake_read, wake_write))
        elif optional is not None and optional.poll():
            optional = None
            on_ready()


def _start_job(listener: socket.socket, children: dict[int, socket.socket], wake_fds: tuple[int, int]) -> None:
    """Accept one job's request and fork the child that becomes it."""
    connection, _ = listener.accept()
    try:
        request, fds = _receive(connection)
    except (OSError, ValueError) as exc:
        print(f"warm start: a bad request ({exc})", flush=True)
        connection.close()
        return
    if _hung_up(connection):  # it gave up waiting and runs the job itself: a second copy must not start
        print(f"warm start: the client {request.get('client_pid')} left before its job started; not starting it", flush=True)
        for fd in fds:
            os.close(fd)
        connection.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for fd in wake_fds:
            os.close(fd)
        _become_job(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    children[pid] = connection
    print(f"warm start: job {pid} started in {request['cwd']}", flush=True)
    with contextlib.suppress(OSError):
        connection.sendall(f"pid {pid}\n".encode())


def _why_not_fork_safe(cuda_initialised: bool, gpu_visible: bool, gpu_usable: bool) -> str | None:
    """Why this process, its imports done, cannot fork jobs that use the GPU; None if it can.

    torch's flag (``cuda_initialised``) misses a library that initialised the CUDA driver itself: a child
    forked after that fails at its first CUDA call. Hence the second check: where a child forked before
    the imports saw a GPU (``gpu_visible``), one forked after them must still be able to use it."""
    if cuda_initialised:
        return "importing the stack initialised CUDA, so this process cannot fork jobs"
    if gpu_visible and not gpu_usable:
        return "importing the stack initialised the CUDA driver: a forked child cannot use the GPU"
    return None


def _fork_check(check) -> int:
    """Start ``check()`` in a child forked now (nothing it does touches this process); its pid, for
    ``_check_result``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)
    return pid


def _check_result(pid: int, block: bool = True) -> bool | None:
    """Whether the check in child ``pid`` held (False also if it failed, or is no child of ours); without
    ``block``, None while it still runs."""
    try:
        done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return False
    return None if done == 0 else os.waitstatus_to_exitcode(status) == 0


def _in_forked_child(check) -> bool:
    return _check_result(_fork_check(check))


def _sees_gpu() -> bool:
    """For a forked child (asked here, it would initialise the driver in this process)."""
    import torch

    return torch.cuda.is_available()


def _can_use_gpu() -> bool:
    """An allocation, not only a device count: torch keeps the count once it has it, and a child inherits
    it, so only a real CUDA call shows whether the driver still works after the fork."""
    import torch

    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        return False
    return True


def _forked_child_can_use_gpu() -> bool:
    return _in_forked_child(_can_use_gpu)


def _imports_leaving_cuda_alone(name: str, gpu_visible: bool):
    """A check for a forked child: whether ``name`` imports leaving CUDA alone: torch's flag unset and,
    where there is a GPU, the driver too (a grandchild can still use the GPU)."""
    def check() -> bool:

        import torch

        importlib.import_module(name)
        return not torch.cuda.is_initialized() and (not gpu_visible or _forked_child_can_use_gpu())

    return check


def _give_up(path: Path, reason: str) -> int:
    """Serve nothing, and say why in ``<key>.failed``: later jobs of this key run inline without trying again."""
    print(f"warm start: not serving: {reason}", flush=True)
    path.with_suffix(".failed").write_text(reason + "\n", encoding="utf-8")
    return 1


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    connection.settimeout(CONNECT_TIMEOUT_S)
    data, fds, _flags, _address = socket.recv_fds(connection, 1 << 16, 3)
    if len(fds) != 3 or len(data) < 8:
        for fd in fds:
            os.close(fd)
        raise ValueError("expected the job's three standard streams and its request")
    size = int.from_bytes(data[:8], "big")
    body = bytearray(data[8:])
    while len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            raise ValueError("the request ended early")
        body += chunk
    connection.settimeout(None)
    return json.loads(body), fds


def _hung_up(connection: socket.socket) -> bool:
    """Whether the other end of ``connection`` has closed it (nothing more to read, ever)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _reap(children: dict[int, socket.socket]) -> None:
    """Collect ended jobs (only those: the probe children are OptionalImports'); tell each one's client its exit
    status (a signal's death as 128 + signal)."""
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 1 << 8  # not ours to wait for any more: its status is lost, reported as 1
        if done == 0:
            continue
        code = os.waitstatus_to_exitcode(status)
        code = code if code >= 0 else 128 - code
        print(f"warm start: job {pid} exited with {code}", flush=True)
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"exit {code}\n".encode())
            connection.close()


def _become_job(request: dict, fds: list[int]) -> None:
    """In the forked child: become the job's process (streams, directory, environment, arguments), run
    its command and exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, *FORWARDED_SIGNALS):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        _apply_per_job_settings()
        environment.job_started_at = float(request["client_started"])
        environment.warm_start_wait_s = float(request["ready_wait_s"])

        # The client is what Snakemake started and will stop: if it disappears, so does this job.
        lifeline.watch(int(request["client_pid"]), what="the job's command")
        sys.argv = [sys.argv[0], *request["argv"]]
        # As `python -m ftbench <argv>` would run it: the package's entry point, already imported here.
        runpy.run_module("ftbench", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the job's traceback goes to its log, as in a process of its own
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what the job registered (and the libraries), as at a normal exit
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _apply_per_job_settings() -> None:
    """What a fresh process would have taken from its environment at start-up, taken from the job's:
    the temp folder (tempfile caches it) and the thread pools' sizes (the BLAS libraries read their
    variable when loaded, in the warm process; torch's pool is sized by the job's --threads)."""
    tempfile.tempdir = None
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return
        threadpool_limits(int(threads))


def stop_server(path: Path) -> bool:
    """End the warm process serving ``path`` (``stop``; it also idles out by itself)."""
    try:
        pid = int(path.with_suffix(".lock").read_text().strip())
    except (OSError, ValueError):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        return True
    return False


USAGE = """python -m ftbench.cluster.warmstart where | start | stop | serve SOCKET
  where   the socket a train job started here (this folder, this environment) would use; its log is beside it
  start   start that warm process in the background unless it runs; --wait: return once it has imported all it
          will (the workflow does this when it starts)
  stop    end the warm process of that socket (it also ends by itself after FTBENCH_WARM_IDLE_S idle seconds)
  serve   be the warm process at SOCKET (what the first train job starts)"""


def main(argv: list[str]) -> int:
    # Through the package's module, not this __main__ copy (python -m runs the file as __main__).
    from ftbench.cluster import warmstart

    if argv[:1] == ["serve"] and len(argv) == 2:
        return warmstart.serve(Path(argv[1]))
    if argv in (["start"], ["start", "--wait"]):
        warmstart.start_ahead(wait=argv[1:] == ["--wait"])
        return 0
    if argv in (["where"], ["stop"]):
        path = warmstart.socket_path()
        if path is None:
            print("ftbench: warm start: no private runtime folder (XDG_RUNTIME_DIR or the temp folder)", file=sys.stderr)
            return 1
        if argv == ["where"]:
            print(path)
            return 0
        return 0 if warmstart.stop_server(path) else 1
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
