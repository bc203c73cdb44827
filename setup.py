"""Build of fastattn's compiled core: src_c/*.c plus the Cython binding.

OpenMP: probed by compiling and linking a test program with -fopenmp.  When it
is missing the build says so and the library runs single-threaded.
  FASTATTN_USE_OPENMP=0      build without OpenMP
  FASTATTN_REQUIRE_OPENMP=1  fail the build when OpenMP is missing (CI)
  FASTATTN_EXTRA_CFLAGS, FASTATTN_EXTRA_LDFLAGS   more flags (CI: sanitizers, -Werror)
  FASTATTN_EXTRA_CFLAGS=-DFA_NO_AVX512   leave out the AVX-512 kernels (CI's sanitizer build)
  FASTATTN_BUILD_JOBS=N      compile the C sources in N threads (default: one per CPU, at most 8)
No -march flag and no fast-math flags: the AVX2 and AVX-512 kernels carry their own target
pragma and are chosen at run time (src_c/dispatch.c); fast-math would break
-inf masks, NaN propagation and the logsumexp output.
"""
import os
import shlex
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=fast: a * b + c in the kernels becomes one FMA instruction (the AVX2 and AVX-512
# micro-kernels and the exp polynomial are written that way).  It is gcc's default only in GNU C
# modes: a -std=c11 in CFLAGS turns it off, and the AVX2 build then has no FMA at all (0.86x at
# B1 H4 N2048 float32, and the float64 exp 1.13 ulp).  clang accepts the same flag.  -g0: no debug
# info in wheels.  -falign-functions=64: each kernel starts on a cache line, so that its hot loops
# sit where its own code puts them, not where the size of the files linked before it does: a change
# of dispatch code that moved every kernel by 16 bytes cost decoding 2-3 % (H32 Nk4096 d128), and
# with the flag both builds ran alike.
BASE_CFLAGS = ["-O3", "-g0", "-fno-math-errno", "-ffp-contract=fast", "-falign-functions=64", "-Wall",
               "-Wextra"]
NO_OMP_MSG = (
    "\n" + "*" * 72 + "\n"
    "fastattn: the compiler has no OpenMP support; building the SINGLE-THREADED\n"
    "library.  Install an OpenMP runtime (libgomp with gcc, libomp with clang).\n"
    + "*" * 72 + "\n"
)


def _has_openmp(compiler):
    """Compile and link a small OpenMP program with the build's compiler."""
    src = ("#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel\n{\n#pragma omp atomic\nn++;}\n"
           "return omp_get_max_threads()>0?0:1;}\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "omp_probe.c")
        with open(path, "w") as f:
            f.write(src)
        try:
            objs = compiler.compile([path], output_dir=tmp, extra_postargs=["-fopenmp"])
            compiler.link_executable(objs, "omp_probe", output_dir=tmp, extra_postargs=["-fopenmp"])
        except Exception:
            return False
    return True


def _parallel_compile(compiler, jobs):
    """Make compiler.compile build its sources in `jobs` threads, one source per call.

    The twelve kernel files (src_c/kernels_*.c) take seconds each at -O3 (minutes under the
    sanitizers); setuptools compiles the sources of one extension one after the other.
    """
    serial = compiler.compile

    def compile_parallel(sources, output_dir=None, *args, **kwargs):
        if jobs < 2 or len(sources) < 2:
            return serial(sources, output_dir, *args, **kwargs)
        # the object directories first, so the threads do not race to create them
        for obj in compiler.object_filenames(sources, output_dir=output_dir):
            os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)
        with ThreadPoolExecutor(jobs) as pool:
            parts = pool.map(lambda src: serial([src], output_dir, *args, **kwargs), sources)
            return [obj for objs in parts for obj in objs]

    compiler.compile = compile_parallel


def _build_jobs():
    """FASTATTN_BUILD_JOBS, or one compiler per CPU this process may use, at most 8."""
    env = os.environ.get("FASTATTN_BUILD_JOBS")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            sys.exit(f"fastattn: FASTATTN_BUILD_JOBS={env!r}: expected a positive integer")
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(8, cpus)


class BuildExt(build_ext):
    def build_extensions(self):
        _parallel_compile(self.compiler, _build_jobs())
        use = os.environ.get("FASTATTN_USE_OPENMP", "1") != "0"
        omp = use and self.compiler.compiler_type != "msvc" and _has_openmp(self.compiler)
        if omp:
            print("fastattn: OpenMP found, building the multithreaded library")
        elif use:
            if os.environ.get("FASTATTN_REQUIRE_OPENMP") == "1":
                sys.exit("fastattn: FASTATTN_REQUIRE_OPENMP=1 but OpenMP is not available")
            print(NO_OMP_MSG)
        else:
            print("fastattn: FASTATTN_USE_OPENMP=0, building the single-threaded library")
        cflags = BASE_CFLAGS + (["-fopenmp"] if omp else []) + shlex.split(os.environ.get("FASTATTN_EXTRA_CFLAGS", ""))
        ldflags = (["-fopenmp"] if omp else []) + shlex.split(os.environ.get("FASTATTN_EXTRA_LDFLAGS", ""))
        if omp and sys.platform.startswith("linux"):
            ldflags.append("-ldl")  # dladdr (show_config's OpenMP library) on older glibc
        for ext in self.extensions:
            ext.extra_compile_args = cflags
            ext.extra_link_args = ldflags
            ext.define_macros = [m for m in ext.define_macros if m[0] != "FA_BUILD_CFLAGS"] + [
                ("FA_BUILD_CFLAGS", '"' + " ".join(cflags).replace('"', "") + '"')]
        super().build_extensions()


ext = Extension(
    "fastattn._core",
    sources=["fastattn/_core.pyx"] + sorted(glob("src_c/*.c")),
    include_dirs=["src_c", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    depends=sorted(glob("src_c/*.h") + glob("src_c/kernel/*.h")),
)

setup(
    ext_modules=cythonize([ext], compiler_directives={"language_level": "3"}),
    cmdclass={"build_ext": BuildExt},
)
