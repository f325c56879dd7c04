#!/usr/bin/env bash
# Build .device/pytest_site.tar.xz: pytest for the GPU machine in ~370 KB instead of the 1.8 MB
# of wheels in .device/pytest, so that the server bundle (63.9 MB), the tokenizer and the repo fit
# one 64 MiB carry with the GPU tests. From the wheels (pip download --no-deps pytest pluggy
# iniconfig packaging pygments): pytest, pluggy, iniconfig whole; pygments cut to what
# _pytest/_io/terminalwriter.py imports (its lexers except python/diff, formatters except
# terminal, styles except default); packaging left out (pytest imports it only for
# `minversion` / `required_plugins`, which pyproject.toml does not set). Checked by running a
# failing test with `python -S` and only this site on the path.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for w in .device/pytest/pytest-*.whl .device/pytest/pluggy-*.whl .device/pytest/iniconfig-*.whl \
         .device/pytest/pygments-*.whl; do
  python3 -m zipfile -e "$w" "$work/site/"
done
cd "$work/site"
find pygments/lexers -name "*.py" ! -name __init__.py ! -name _mapping.py ! -name python.py \
  ! -name diff.py -delete
find pygments/formatters -name "*.py" ! -name __init__.py ! -name _mapping.py ! -name terminal.py \
  -delete
find pygments/styles -name "*.py" ! -name __init__.py ! -name _mapping.py ! -name default.py -delete
rm -rf pygments/cmdline.py pygments-*.dist-info pluggy-*.dist-info iniconfig-*.dist-info
find . -name __pycache__ -prune -exec rm -rf {} +
printf 'def test_fails():\n    assert 1 == 2\n' > "$work/test_check.py"
if python3 -S -c "import sys; sys.path.insert(0, '.'); import pytest; \
    sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '$work/test_check.py']))" \
    > "$work/check.log" 2>&1; then
  echo "pytest_site: the check test passed; it must fail"; exit 1
fi
grep -q "1 failed" "$work/check.log" || { cat "$work/check.log"; exit 1; }
tar -cf - . | xz -9e > "$OLDPWD/.device/pytest_site.tar.xz"
ls -l "$OLDPWD/.device/pytest_site.tar.xz"
