"""Build and load the CPU kernels written in C (`kernels/cpu/*.c`): compiled once per machine with
the system C compiler (`cc`, or $CC) for this CPU (-march=native, OpenMP), cached under
`~/.cache/specserve/kernels` (`SPECSERVE_CACHE_DIR`) by a key of the source (with the sources it
includes: `decoder.c` is built from the others'), the compiler's version, the CPU's flags and the
compiler flags, and loaded with ctypes. A build takes about a second. `SPECSERVE_CFLAGS` adds
flags after the defaults (`-mno-avx512f` builds the AVX2 form of the kernels on an AVX-512 CPU).

The shared library links libgomp.so.1; torch has already loaded its own copy under that name, so
the kernels share torch's OpenMP thread pool instead of starting a second one.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c11"]


class BuildError(RuntimeError):
    """The C kernels cannot be built or loaded on this machine (no compiler, a failed build)."""


def cache_dir() -> Path:
    """specserve's cache folder, not created (`spec_phases/paths.cache_dir` reads it here too:
    kernels import nothing above them)."""
    root = os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specserve")
    return Path(root)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler (cc, gcc or $CC) on PATH")
    return cc


def _source_text(source: Path) -> str:
    """The source with the text of every file it includes by `#include "<file>"` (from this
    folder, recursively): a kernel built from others' sources is rebuilt when they change."""
    try:
        text = source.read_text()
    except OSError as exc:
        raise BuildError(f"cannot read {source}: {exc}") from exc
    included = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return "\0".join([text, *(_source_text(SOURCE_DIR / name) for name in included)])


def build(name: str) -> Path:
    """`kernels/cpu/<name>.c` compiled into a cached shared library (built when missing)."""
    source = SOURCE_DIR / f"{name}.c"
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cc} --version failed: {exc}") from exc
    text = _source_text(source)
    flags = [*FLAGS, *shlex.split(os.environ.get("SPECSERVE_CFLAGS", ""))]
    key = hashlib.sha256("\0".join([text, version, _cpu_flags(), platform.machine(),
                                    " ".join(flags)]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        raise BuildError(f"cannot write the kernel cache {target.parent}: {exc}") from exc
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            raise BuildError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)                  # atomic: a concurrent build loses nothing
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"building {source.name}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU kernel %s into %s", name, target)
    return target


@functools.cache
def library(name: str) -> ctypes.CDLL:
    """The loaded library of `kernels/cpu/<name>.c`; raises BuildError where it cannot be had."""
    path = build(name)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise BuildError(f"loading {path}: {exc}") from exc
