"""Issue 38: paths bundle.json records leak nothing of other files; `-o` replaces only a folder
kerncc marked as its own, and a crash midway leaves the old bundle or the new one.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kerncc.cli.main import main
from kerncc.example import generate


def cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> Path:
    model, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    out = model.parent / "out"
    assert main(["lower", str(model), "-p", "emit", "-o", str(out)]) == 0
    return out


@pytest.fixture
def bundle(emitted, tmp_path) -> Path:
    """A copy of the bundle beside copies of its input and checkpoint."""
    for name in ("model.json", "model.safetensors"):
        shutil.copy(emitted.parent / name, tmp_path / name)
    shutil.copytree(emitted, tmp_path / "out")
    return tmp_path / "out"


def edit_index(bundle: Path, edit) -> None:
    index = json.loads((bundle / "bundle.json").read_text())
    edit(index)
    (bundle / "bundle.json").write_text(json.dumps(index, indent=1))


# ---------------------------------------------------------------------------------------------
# 38.3: nothing of a file a recorded path leads to reaches a message


SECRET = "root:x:0:0:SECRET-LINE:/root:/bin/bash\n"


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "passwd"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def leaks(text: str, path: Path) -> bool:
    data = path.read_bytes()
    return any(s in text for s in ("SECRET-LINE", hashlib.sha256(data).hexdigest()[:12],
                                   str(int.from_bytes(data[:8], "little"))))


@pytest.mark.parametrize("keep_sha", [False, True])
def test_an_input_path_leading_elsewhere_shows_nothing_of_the_file(bundle, secret, keep_sha):
    def point(index):
        index["input"]["path"] = "../elsewhere/passwd"
        if not keep_sha:
            index["input"]["sha256"] = None

    edit_index(bundle, point)
    for command in ("check", "report"):
        code, text = cli(command, str(bundle))
        assert not leaks(text, secret), text
    assert cli("check", str(bundle))[0] == 1


def test_an_input_manifest_elsewhere_is_not_opened_without_its_sha256(bundle, tmp_path):
    other = tmp_path / "elsewhere.json"
    other.write_text('{"not": "a manifest", "secret": "SECRET-LINE"}')
    edit_index(bundle, lambda i: i["input"].update(path="../elsewhere.json", sha256=None))
    code, text = cli("check", str(bundle))
    assert code == 1 and "SECRET-LINE" not in text and "records no sha256" in text


@pytest.mark.parametrize("name", ["passwd", "secret.safetensors"])
def test_a_checkpoint_path_leading_elsewhere_shows_nothing_of_the_file(bundle, tmp_path, name):
    secret = tmp_path / "elsewhere" / name
    secret.parent.mkdir()
    secret.write_bytes(b"SECRETAB" + SECRET.encode())
    edit_index(bundle, lambda i: i.update(checkpoint=f"../elsewhere/{name}"))
    for argv in (("run", str(bundle), "--backend", "cpu", "--prompt", "1,2", "--max-new", "1"),
                 ("report", str(bundle)), ("check", str(bundle))):
        code, text = cli(*argv)
        assert not leaks(text, secret), text
    assert cli("run", str(bundle), "--backend", "cpu", "--prompt", "1,2", "--max-new", "1")[0] \
        == 1


def test_a_checkpoint_without_its_identity_is_not_opened(bundle, tmp_path):
    secret = tmp_path / "elsewhere.safetensors"
    secret.write_bytes(b"SECRETAB" + SECRET.encode())
    edit_index(bundle, lambda i: i.update(checkpoint="../elsewhere.safetensors",
                                          checkpoint_identity=None))
    code, text = cli("run", str(bundle), "--backend", "cpu", "--prompt", "1,2", "--max-new", "1")
    assert code == 1 and not leaks(text, secret) and "not opened" in text, text


# ---------------------------------------------------------------------------------------------
# 38.6: -o replaces only a folder kerncc marked; a crash midway leaves old or new


def test_a_user_folder_that_looks_like_a_bundle_is_not_replaced(emitted, tmp_path):
    mine = tmp_path / "mine"
    shutil.copytree(emitted, mine)
    (mine / ".kerncc-output").unlink()  # the user's folder: a bundle's files, no marker
    before = sorted(p.name for p in mine.rglob("*"))
    code, text = cli("lower", str(emitted.parent / "model.json"), "-p", "emit", "-o", str(mine))
    assert code != 0 and "refusing to overwrite" in text
    assert sorted(p.name for p in mine.rglob("*")) == before


CRASH = """
import os, sys
from pathlib import Path
from kerncc import atomic
real = atomic.exchange
step = sys.argv[1]
def crash_before(a, b):
    os._exit(9)
def crash_after(a, b):
    real(a, b)
    os._exit(9)
renames = []
real_rename = Path.rename
def crash_between(self, target):
    renames.append(target)
    if len(renames) == 2:
        os._exit(9)
    return real_rename(self, target)
if step == "before":
    atomic.exchange = crash_before
elif step == "after":
    atomic.exchange = crash_after
else:
    atomic.exchange = lambda a, b: False
    Path.rename = crash_between
with atomic.atomic_directory(sys.argv[2]) as tmp:
    (tmp / "stage0.json").write_text("new")
"""


@pytest.mark.parametrize("step", ["before", "after", "between"])
def test_a_crash_while_replacing_leaves_the_old_output_or_the_new(tmp_path, step):
    import subprocess
    import sys

    from kerncc.atomic import atomic_directory, remove_leftovers

    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "stage0.json").write_text("old")
    done = subprocess.run([sys.executable, "-c", CRASH, step, str(target)], timeout=60)
    assert done.returncode == 9
    if step == "between":  # two renames: the next write puts the old output back first
        remove_leftovers(target)
    assert (target / "stage0.json").read_text() == ("new" if step == "after" else "old")
    with atomic_directory(target) as tmp:  # and it is still kerncc's, replaced as usual
        (tmp / "stage0.json").write_text("newer")
    assert (target / "stage0.json").read_text() == "newer"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
