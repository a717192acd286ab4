"""`melix-fsm serve --vision` on the tiny Qwen3.5 VL checkpoint, through the official openai client.

- A chat request with an image (a data: URI) answers mlx-vlm's own greedy output for the
  same prompt and image, token for token (decoded), with MTP drafts accepted; the receipt
  notes the vision tower.
- An image request and a text request in flight together (one batch: the peak rows
  metric says 2) each answer what they answer alone.
- Refusals, typed: bad base64, bytes that are no image, too many images, too large an
  image, a remote url without the operator's allow flag (400 / 413); an image sent to a
  text-only server is a 400 (`images_unsupported`).
Skipped when mlx-vlm or openai is not installed.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from melix_mlx.serve.images import VisionOptions  # noqa: E402
from melix_mlx.serve.provider import load_served_model  # noqa: E402
from melix_mlx.vlm import prepare, reference  # noqa: E402
from serve_helpers import assert_error_shape, client, metric, post_json, raw, serving  # noqa: E402
from vlm_helpers import IMAGE_PROMPT, TEXT_PROMPT, image, loaded_vl, png_bytes, tiny_vl  # noqa: E402

N = 12
LONG = 24  # tokens of the text request's solo run compared
# The tiny tokenizer has no chat template: the server writes mlx-lm's plain chat form, here
# with empty role prefixes (mlx-lm's role_mapping), so the prompt is the message itself, the
# image part as the checkpoint's vision placeholder: IMAGE_PROMPT, where the image decides the
# continuation (under "USER: ... ASSISTANT:" the tiny model answers the same for any image).
PLAIN = {"extra_body": {"role_mapping": {"system": "", "user": "", "assistant": "", "stop": ""}}}


def data_uri(payload: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(payload).decode()


def image_message(*uris: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": TEXT_PROMPT}]}]


def mlx_vlm_text(prompt: str, images: list, n: int) -> str:
    model, processor, _, _ = loaded_vl()
    tokens = reference(model, prepare(model, processor, prompt, images), n)
    return processor.tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def server():
    served = load_served_model(
        str(tiny_vl()), 2, "force_on", vision=VisionOptions(max_images=2, max_image_bytes=60_000)
    )
    with serving(served, max_batch_size=4) as running:
        yield running


def test_an_image_request_is_mlx_vlms_greedy(server):
    messages = image_message(data_uri(png_bytes(0)))
    reply = client(server.url).chat.completions.create(
        model="default_model", messages=messages, max_tokens=N, temperature=0, **PLAIN
    )
    want = mlx_vlm_text(IMAGE_PROMPT, [image(0)], N)
    assert reply.choices[0].message.content == want
    assert want != mlx_vlm_text(IMAGE_PROMPT, [image(1)], N)  # the image decides the answer
    speculative = reply.usage.model_extra["speculative"]
    assert speculative["method"] == "mtp" and speculative["accepted"] > 0, speculative
    status, _, body = raw(server.url, "GET", "/v1/melix/receipt")
    receipt = json.loads(body)
    assert status == 200 and receipt["receipt"]["vision_tower"].startswith("qwen3_5: depth 1"), receipt
    assert receipt["settings"]["vision"] and receipt["settings"]["max_images"] == 2


def test_image_and_text_requests_batch_together(server):
    """The text row streams until the image request has finished and one chunk more, so the
    two rows overlap whatever the machine's speed; then the text request is cancelled."""
    openai = client(server.url)
    text_stream = openai.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": TEXT_PROMPT}], max_tokens=1000,
        temperature=0, stream=True, **PLAIN,
    )  # fmt: skip
    chunks = (c.choices[0].delta.content or "" for c in text_stream if c.choices)
    text = next(chunks)  # the text row decodes: now the image joins
    with ThreadPoolExecutor(1) as pool:
        messages = image_message(data_uri(png_bytes(1)))
        joined = pool.submit(
            openai.chat.completions.create, model="default_model", messages=messages, max_tokens=N,
            temperature=0, **PLAIN,
        )  # fmt: skip
        while not joined.done():
            text += next(chunks)
        text += next(chunks)  # still decoding after the image row left
        with_image = joined.result().choices[0].message.content
    text_stream.close()
    assert with_image == mlx_vlm_text(IMAGE_PROMPT, [image(1)], N)
    solo = mlx_vlm_text(TEXT_PROMPT, [], LONG)
    n = min(len(text), len(solo))
    assert n >= 16 and text[:n] == solo[:n]  # the same greedy run, up to where both got
    assert metric(server.url, "melix_batch_rows_peak") >= 2


def test_an_anthropic_image_block_is_the_openai_image_part(server):
    """/v1/messages with a base64 image block: the prompt the OpenAI route makes of the same
    image as a data: URI (the same input tokens, the image's expanded in), the same greedy
    answer; count_tokens counts the image's tokens too."""
    anthropic = pytest.importorskip("anthropic")
    payload = png_bytes(0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(payload).decode()}
    content = [{"type": "image", "source": source}, {"type": "text", "text": TEXT_PROMPT}]
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = messages.messages.create(
        model="default_model", max_tokens=N, messages=[{"role": "user", "content": content}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    openai_answer = client(server.url).chat.completions.create(
        model="default_model", messages=image_message(data_uri(payload)), max_tokens=N, temperature=0
    )
    assert message.content[0].text == openai_answer.choices[0].message.content
    assert message.usage.input_tokens == openai_answer.usage.prompt_tokens
    text_only = [{"role": "user", "content": TEXT_PROMPT}]
    counted = messages.messages.count_tokens(
        model="default_model", messages=[{"role": "user", "content": content}]
    )
    plain = messages.messages.count_tokens(model="default_model", messages=text_only)
    assert counted.input_tokens == message.usage.input_tokens
    assert counted.input_tokens > plain.input_tokens + 1  # the placeholder expanded to the image's tokens


def _noise_png(side: int) -> bytes:
    out = io.BytesIO()
    pixels = (np.random.default_rng(7).random((side, side, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "uris, status, code",
    [
        (["data:image/png;base64,@@not base64@@"], 400, "invalid_image"),
        ([data_uri(b"these bytes are not an image")], 400, "invalid_image"),
        ([data_uri(png_bytes(0))] * 3, 400, "too_many_images"),
        (["https://example.com/cat.png"], 400, "remote_image_refused"),
        ([None], 413, "image_too_large"),  # a 256 x 256 noise PNG: over the 60 kB bound
    ],
)
def test_bad_images_are_refused_typed(server, uris, status, code):
    uris = [u if u is not None else data_uri(_noise_png(256)) for u in uris]
    got, _, payload = post_json(server.url, "/v1/chat/completions", {"messages": image_message(*uris)})
    assert got == status, payload
    assert_error_shape(payload)
    assert payload["error"]["code"] == code


def test_an_image_to_a_text_only_server_is_a_400():
    """The check behind a text-only server's 400 (test_serve_http sends it over HTTP)."""
    from types import SimpleNamespace

    from melix_mlx.serve.errors import ApiError
    from melix_mlx.serve.images import tokenize

    text_only = SimpleNamespace(served=SimpleNamespace(vision=None))
    request = SimpleNamespace(request_type="chat", messages=image_message(data_uri(png_bytes(0))))
    with pytest.raises(ApiError) as refused:
        tokenize(text_only, None, request, None)
    assert refused.value.status == 400 and refused.value.code == "images_unsupported"
    assert tokenize(text_only, None, SimpleNamespace(request_type="chat", messages=[]), None) is None


def test_a_cached_prefix_continues_as_text():
    """A prefix the prompt cache stored mid-prefill holds its first request's prompt
    features; a row continuing it must not read them (it would decode that prompt)."""
    from melix_mlx.serve.images import row_caches

    model = loaded_vl()[0]
    stored = model.prompt_cache(model.features(mx.array([[5, 6, 7, 8, 9]])))
    (hit,) = row_caches(model, [[[5, 6, 40, 41]]], [stored])
    assert hit is stored and all(getattr(leaf, "prompt", None) is None for leaf in hit)
    (fresh,) = row_caches(model, [[[5, 6], [40, 41]]], None)  # no hit: the whole prompt's features
    assert fresh[model.language_model.model.ssm_idx].prompt.length == 4
