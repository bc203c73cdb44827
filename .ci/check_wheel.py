"""CI: check the built distributions.

    python .ci/check_wheel.py SDIST WHEEL_FROM_SDIST WHEEL_FROM_TREE REPAIRED_WHEEL

- the sdist carries the C sources, the binding and the tests;
- the wheel built from the sdist and the wheel built from the source tree hold
  the same files;
- the repaired wheel holds the package, its compiled core (with the kernels of
  every SIMD path), the typing files, the vendored OpenMP runtime and the
  metadata, and no build leftovers.
"""

import re
import sys
import tarfile
import zipfile

ALLOWED = [
    r"fastattn/[a-z_]+\.py",
    r"fastattn/_core\.cpython-[^/]+\.so",
    r"fastattn/_core\.pyi",
    r"fastattn/py\.typed",
    r"fastattn\.libs/lib(gomp|omp|iomp5)[^/]*\.so[.0-9]*",
    r"fastattn-[^/]+\.dist-info/(METADATA|WHEEL|RECORD|top_level\.txt|entry_points\.txt|licenses/.*|LICENSE.*)",
    r"fastattn-[^/]+\.dist-info/sboms/[^/]+\.json",   # auditwheel's software bill of materials
    r"[^/]+/(sboms/)?",                                   # directory entries
]


def names(whl):
    with zipfile.ZipFile(whl) as z:
        return sorted(z.namelist())


def main(sdist, from_sdist, from_tree, repaired):
    with tarfile.open(sdist) as t:
        members = [m.split("/", 1)[1] for m in t.getnames() if "/" in m]
    for needed in ("src_c/fastattn.h", "src_c/kernel_body.h", "src_c/attention.c", "fastattn/_core.pyx",
                   "setup.py", "pyproject.toml", "README.md", "LICENSE", "tests/helpers.py",
                   "tests/requirements.txt"):
        assert needed in members, f"sdist lacks {needed}"
    a, b = names(from_sdist), names(from_tree)
    assert a == b, f"the wheel from the sdist differs from the wheel from the tree: {set(a) ^ set(b)}"
    files = names(repaired)
    bad = [f for f in files if not any(re.fullmatch(p, f) for p in ALLOWED)]
    assert not bad, f"unexpected files in the wheel: {bad}"
    assert any(re.fullmatch(ALLOWED[4], f) for f in files), "the repaired wheel carries no OpenMP runtime"
    assert not any(f.endswith((".c", ".pyx", ".o", ".h")) for f in files)
    assert any(re.fullmatch(r"fastattn-[^/]+\.dist-info/licenses/LICENSE", f) for f in files), \
        "the wheel carries no LICENSE"
    with zipfile.ZipFile(repaired) as z:
        meta = z.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in meta, "the wheel's metadata names no license"
    # every SIMD path is in the core (CI's sanitizer build leaves AVX-512 out with -DFA_NO_AVX512)
    with zipfile.ZipFile(repaired) as z:
        core = z.read(next(f for f in files if re.fullmatch(ALLOWED[1], f)))
    for isa in ("generic", "avx2", "avx512"):
        for name in (f"fa_attn_item_f32_{isa}", f"fa_attn_item_f64_{isa}"):
            assert name.encode() in core, f"the compiled core lacks {name}"
    print(f"{repaired}: {len(files)} files, all expected; sdist and tree wheels agree ({len(a)} files)")
    for f in files:
        print("   ", f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
