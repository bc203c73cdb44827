# Shell helpers shared by .ci/run and .ci/wheels (sourced; PIP set by the caller).

fresh_venv() {  # fresh_venv DIR [PYTHON]: create (with PYTHON, default python3) and activate
    "${2:-python3}" -m venv "$1"
    # shellcheck disable=SC1091
    . "$1/bin/activate"
    $PIP install --quiet --upgrade pip
}

test_copy() {  # test_copy DIR: the tests, examples, docs, README and CHANGELOG in DIR, to run outside the checkout
    mkdir "$1"
    cp -r tests examples docs README.md CHANGELOG.md "$1/"
}

find_python() {  # find_python 3.9: that interpreter, from pyenv or PATH (a pyenv shim may not run)
    local p
    for p in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/$1".*/bin/python "python$1"; do
        "$p" -c "import venv" >/dev/null 2>&1 && { command -v "$p"; return 0; }
    done
    echo "Python $1 not found (pyenv or PATH): this step needs it" >&2
    return 1
}
