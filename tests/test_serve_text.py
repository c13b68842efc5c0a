"""`kerncc serve` with the example's own tokenizer.json and chat template (kerncc.hf.tokenizer):
text prompts, chat messages and the official openai client, end to end on 127.0.0.1.

The stand-in codec of test_serve_http.py checks the server's logic; this checks the real
pieces fit: a text prompt gives the tokens its ids give, a chat request gives the tokens
`kerncc run --chat` gives for the same message, and the answer's text is the decoded ids.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("uvicorn")

from kerncc.example import generate  # noqa: E402
from kerncc.hf.tokenizer import TextCodec  # noqa: E402
from kerncc.lower import lower_to_bundle  # noqa: E402
from kerncc.runtime import Chain  # noqa: E402
from serving import serving  # noqa: E402

MESSAGE = "hello there"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def codec(model) -> TextCodec:
    found = TextCodec.from_dir(model.parent)
    assert found is not None and found.has_chat_template
    return found


@pytest.fixture(scope="module")
def base(model, codec):
    with serving(Chain(lower_to_bundle(model)), "tiny", codec) as (url, _):
        yield url


def post(base: str, path: str, **body) -> dict:
    answer = httpx.post(f"{base}{path}", json={"model": "tiny", **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_text_prompt_gives_what_its_ids_give(base, codec):
    prompt = "the quick brown fox"
    by_text = post(base, "/v1/completions", prompt=prompt, max_tokens=6)["choices"][0]
    by_ids = post(base, "/v1/completions", prompt=codec.encode(prompt),
                  max_tokens=6)["choices"][0]
    assert by_text["token_ids"] == by_ids["token_ids"]
    assert len(by_text["token_ids"]) >= 1
    assert by_text["text"] == codec.decode(
        [t for t in by_text["token_ids"] if t not in codec.eos_token_ids])


def test_chat_gives_what_kerncc_run_chat_gives(base, codec, model, capsys):
    from kerncc.cli.main import main

    chat = post(base, "/v1/chat/completions", max_tokens=6,
                messages=[{"role": "user", "content": MESSAGE}])
    assert chat["object"] == "chat.completion"
    ids = chat["choices"][0]["token_ids"]
    assert main(["run", str(model), "--chat", MESSAGE, "--max-new", "6", "--format",
                 "json"]) == 0
    import json
    ran = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ids == ran["ids"]
    prompt = codec.encode(codec.apply_chat_template(
        [{"role": "user", "content": MESSAGE}], add_generation_prompt=True),
        add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == len(prompt)


def test_the_openai_client_chats(base):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": MESSAGE}], max_tokens=5)
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
