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
