"""Images in chat requests: a vision-language checkpoint served through the mlx-vlm adapter.

Rules of this module:
- Opt-in: `melix-fsm serve --vision` loads the checkpoint with mlx-vlm
  (melix_mlx.vlm.load_vlm: its processor and vision tower, the head through the registry)
  and starts it as every server starts (`start_vision`: receipt for a batched context,
  device policy); the receipt notes the vision tower. Without it, a request with an image
  is a 400 (`images_unsupported`), never silently stripped.
- A chat message's content may hold `{"type": "image_url", "image_url": {"url": ...}}`
  parts. The url is a `data:` URI with base64 bytes; an http(s) url is refused (400,
  `remote_image_refused`) unless the operator allowed remote images, and then fetched
  with a timeout and the same byte bound. Bounded per request: at most `max_images`
  images (400, `too_many_images`), each at most `max_image_bytes` encoded bytes (413,
  `image_too_large`) and `max_image_pixels` pixels (413). Bad base64 or bytes PIL cannot
  decode are a 400 (`invalid_image`). Every refusal is an ApiError naming the field.
- Tokenization (on the server's tokenizer thread, before the request is queued): each
  image part becomes the checkpoint's vision placeholder in the message text, the chat
  template (or mlx-lm's plain chat form without one) makes the prompt text, and mlx-vlm's
  own processor (`prepare_inputs`) expands the placeholders and makes the pixel values.
  The token ids carry the pixel inputs with them (`ImagePrompt`).
- On the generation thread, when a row is inserted (`row_caches`): every row of a VL
  model without a cached prefix gets a fresh cache carrying its prompt as mlx-vlm prepares
  it (the vision tower runs there), so image and text rows join one batch and decode
  with MTP together (melix_mlx.vlm.text carries each row's rope delta). A text row that
  continues a cached prefix continues it as text: a prompt stored with the prefix (a
  segment's copy, taken mid-prefill) is another request's and is dropped.
- Image placeholders are the same token ids whatever the image: a prompt holding them
  is never looked up in, nor stored into, the prompt cache (`ImageSafeCache`).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from .errors import ApiError

IMAGE_PART = "image_url"
REMOTE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class VisionOptions:
    """The operator's bounds on images (`melix-fsm serve` flags)."""

    max_images: int = 4  # per request
    max_image_bytes: int = 4 << 20  # encoded bytes of one image
    max_image_pixels: int = 4096 * 4096  # pixels of one decoded image
    allow_remote: bool = False  # fetch http(s) image urls


@dataclass(frozen=True)
class VisionServing:
    """What a VL server needs to take images: mlx-vlm's processor and the bounds."""

    processor: Any
    tower: str | None  # melix_mlx.vlm.VLMInfo.vision_tower
    placeholder: str  # the text an image part becomes (vision start, image pad, vision end)
    image_tokens: frozenset[int]  # token ids that stand for image content
    options: VisionOptions

    def receipt(self, receipt: dict[str, Any]) -> dict[str, Any]:
        """The served receipt, with the vision tower."""
        return {**receipt, "vision_tower": self.tower}

    def settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The served settings, with the image bounds."""
        return {**settings, "vision": True, **asdict(self.options)}


class ImagePrompt(list):
    """A prompt's token ids with mlx-vlm's pixel inputs beside them (numpy, made on the
    tokenizer thread; the generation thread builds its arrays)."""

    pixel_values: np.ndarray
    grid: np.ndarray | None


# -- loading ---------------------------------------------------------------------------


def start_vision(path: Any, config: Any, context: Any, options: VisionOptions, **start_kw: Any) -> tuple:
    """`(start, VisionServing)`: the checkpoint loaded by mlx-vlm, started as `start` starts
    every served model (melix_mlx.decoding.startup); a refused head serves plainly, still
    through mlx-vlm (the images keep working)."""
    from mlx_lm.utils import load_config, load_tokenizer

    from melix_fsm.lifecycle import SequenceMachine

    from ..decoding.startup import StartFailed, start

    try:
        from ..vlm import load_vlm, placeholder
    except ImportError as exc:
        raise StartFailed(f"--vision needs mlx-vlm (pip install 'melix-fsm[vlm]'): {exc}") from exc
    machine = SequenceMachine(0)
    try:
        model, processor, head, info = load_vlm(path, speculative=config, context=context, machine=machine)
    except Exception as exc:  # noqa: BLE001 - a checkpoint mlx-vlm cannot load is a usage error
        raise StartFailed(f"cannot load {path} with mlx-vlm: {type(exc).__name__}: {exc}") from exc
    raw = load_config(path)
    text = raw.get("text_config") or {}
    tokenizer = load_tokenizer(path, eos_token_ids=raw.get("eos_token_id", text.get("eos_token_id")))
    boot = start(
        path,
        config,
        context,
        receipt=info.receipt,
        machine=machine,
        preloaded=(model, tokenizer, head),
        **start_kw,
    )
    if boot.model is not model:  # refused: `start` loaded the text model plainly; serve the VL one
        boot = replace(boot, model=model, tokenizer=tokenizer, head=None)
    vision = VisionServing(
        processor=processor,
        tower=info.vision_tower,
        placeholder=placeholder(tokenizer, raw),
        image_tokens=frozenset(
            t for t in (raw.get("image_token_id"), raw.get("video_token_id")) if t is not None
        ),
        options=options,
    )
    return boot, vision


# -- the HTTP side ---------------------------------------------------------------------


def image_parts(messages: Any) -> list[dict[str, Any]]:
    """The image parts of a request's messages, in order."""
    out = []
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            out.extend(p for p in content if isinstance(p, dict) and p.get("type") == IMAGE_PART)
    return out


def _url(part: dict[str, Any]) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ApiError(
            400, 'an image part needs {"image_url": {"url": ...}}', param="messages", code="invalid_image"
        )
    return url


def _too_large(options: VisionOptions) -> ApiError:
    limit = options.max_image_bytes
    return ApiError(413, f"an image may be at most {limit} bytes", param="messages", code="image_too_large")


def image_bytes(url: str, options: VisionOptions) -> bytes:
    """The encoded bytes of one image url (see the module rules)."""
    if url.startswith("data:"):
        header, comma, data = url[5:].partition(",")
        if not comma or not header.endswith(";base64"):
            raise ApiError(400, "an image data URI must be base64 (data:<type>;base64,...)", param="messages",
                           code="invalid_image")  # fmt: skip
        if len(data) * 3 // 4 > options.max_image_bytes + 3:
            raise _too_large(options)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "an image data URI is not valid base64", param="messages",
                           code="invalid_image") from None  # fmt: skip
    elif url.startswith(("http://", "https://")):
        if not options.allow_remote:
            raise ApiError(400, "remote image urls are refused here: send the image as a data: URI "
                           "(or start the server with --allow-remote-images)", param="messages",
                           code="remote_image_refused")  # fmt: skip
        raw = _fetch(url, options)
    else:
        raise ApiError(400, "an image url must be a data: URI (or http(s) where the server allows it)",
                       param="messages", code="invalid_image")  # fmt: skip
    if len(raw) > options.max_image_bytes:
        raise _too_large(options)
    return raw


def _fetch(url: str, options: VisionOptions) -> bytes:
    from urllib.error import URLError
    from urllib.request import urlopen

    try:
        with urlopen(url, timeout=REMOTE_TIMEOUT_S) as response:  # noqa: S310 - http(s) only, operator-allowed
            return response.read(options.max_image_bytes + 1)
    except (URLError, OSError, ValueError) as exc:
        raise ApiError(400, f"the image url could not be fetched: {type(exc).__name__}", param="messages",
                       code="invalid_image") from None  # fmt: skip


def decode_image(raw: bytes, options: VisionOptions) -> Any:
    """An RGB PIL image from encoded bytes; 400 when PIL cannot decode them, 413 past the pixel bound."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(raw))
        width, height = image.size
        if width * height > options.max_image_pixels:
            raise ApiError(413, f"an image may have at most {options.max_image_pixels} pixels",
                           param="messages", code="image_too_large")  # fmt: skip
        image.load()
        return image.convert("RGB")
    except ApiError:
        raise
    except Exception:  # noqa: BLE001 - whatever PIL raises for bytes that are not an image
        raise ApiError(400, "an image could not be decoded", param="messages", code="invalid_image") from None


def _as_text(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """The messages with each content list as text, an image part as the placeholder."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            pieces = [placeholder if p.get("type") == IMAGE_PART else p.get("text", "") for p in content]
            message = {**message, "content": "".join(pieces)}
        out.append(message)
    return out


def tokenize(generator: Any, tokenizer: Any, request: Any, args: Any) -> tuple | None:
    """mlx-lm's `_tokenize` result for a chat request with images (None: it has none)."""
    parts = image_parts(getattr(request, "messages", None)) if request.request_type == "chat" else []
    if not parts:
        return None
    vision: VisionServing | None = getattr(generator.served, "vision", None)
    if vision is None:
        raise ApiError(400, "this server's model takes no images (serve a vision-language checkpoint with "
                       "--vision)", param="messages", code="images_unsupported")  # fmt: skip
    options = vision.options
    if len(parts) > options.max_images:
        raise ApiError(400, f"images per request: at most {options.max_images}", param="messages",
                       code="too_many_images")  # fmt: skip
    images = [decode_image(image_bytes(_url(p), options), options) for p in parts]
    messages = _as_text(request.messages, vision.placeholder)
    text = _chat_text(generator, tokenizer, request, args, messages)
    from mlx_vlm.utils import prepare_inputs

    try:
        inputs = prepare_inputs(vision.processor, images=images, prompts=[text])
    except ValueError as exc:  # e.g. the text names more images than the request holds
        raise ApiError(400, f"the prompt and its images do not match: {exc}", param="messages",
                       code="invalid_image") from None  # fmt: skip
    prompt = ImagePrompt(int(t) for t in np.array(inputs["input_ids"][0]))
    prompt.pixel_values = np.array(inputs["pixel_values"])
    grid = inputs.get("image_grid_thw")
    prompt.grid = None if grid is None else np.array(grid)
    return prompt, [prompt], ["assistant"], _initial_state(tokenizer, prompt), None


def _chat_text(generator: Any, tokenizer: Any, request: Any, args: Any, messages: list[dict]) -> str:
    """The prompt text as mlx-lm's `_tokenize` makes it (the template, else its plain chat form)."""
    from mlx_lm.server import convert_chat

    if not tokenizer.has_chat_template:
        return convert_chat(messages, request.role_mapping)
    template_args = dict(generator.model_provider.cli_args.chat_template_args or {})
    template_args.update(args.chat_template_kwargs or {})
    return tokenizer.apply_chat_template(
        messages, tools=request.tools, add_generation_prompt=True, tokenize=False, **template_args
    )


def _initial_state(tokenizer: Any, prompt: list[int]) -> str:
    """mlx-lm's initial state of a chat prompt (thinking when it ends inside a think block)."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return tokenizer.response_initial_state or state


# -- the generation thread -------------------------------------------------------------


def row_caches(model: Any, segments: list, caches: list | None) -> list | None:
    """Each row's cache for `insert_segments`: on a VL model (melix_mlx.vlm.VLMText) a row with
    nothing cached gets a fresh cache carrying its prompt as mlx-vlm prepares it; other
    models' caches are returned as given."""
    features = getattr(model, "features", None)
    if features is None or not hasattr(model, "prompt_cache"):
        return caches
    import mlx.core as mx

    out = list(caches) if caches is not None else [None] * len(segments)
    for i, row in enumerate(segments):
        vision = next((s for s in row if isinstance(s, ImagePrompt)), None)
        if out[i] is not None:
            if vision is not None:
                raise ValueError("a prompt with images cannot continue a cached prefix")
            for leaf in out[i]:  # a stored prefix may hold its first request's prompt: not this one's
                if getattr(leaf, "prompt", None) is not None:
                    leaf.prompt = None
            continue
        ids = mx.array([[t for s in row for t in s]])
        if vision is None:
            prompt = features(ids)
        else:
            kw = {} if vision.grid is None else {"image_grid_thw": mx.array(vision.grid)}
            prompt = features(ids, mx.array(vision.pixel_values), **kw)
        out[i] = model.prompt_cache(prompt)
    return out


def image_safe(prompt_cache: Any, served: Any) -> Any:
    """The server's prompt cache, wrapped in `ImageSafeCache` where the served model takes images."""
    vision = getattr(served, "vision", None)
    return prompt_cache if vision is None else ImageSafeCache(prompt_cache, vision.image_tokens)


class ImageSafeCache:
    """mlx-lm's prompt cache, never consulted for prompts that hold image tokens."""

    def __init__(self, shared: Any, image_tokens: frozenset[int]) -> None:
        self._shared = shared
        self._image_tokens = image_tokens

    def _has_images(self, tokens: Any) -> bool:
        return isinstance(tokens, ImagePrompt) or not self._image_tokens.isdisjoint(tokens)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        if self._has_images(tokens):
            return None, tokens
        return self._shared.fetch_nearest_cache(model, tokens)

    def insert_cache(self, model: Any, tokens: list[int], *args: Any, **kwargs: Any) -> Any:
        if self._has_images(tokens):
            return None
        return self._shared.insert_cache(model, tokens, *args, **kwargs)

    def __len__(self) -> int:
        return len(self._shared)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


def no_image_parts(messages: Any) -> list[dict[str, Any]]:
    """What mlx-lm's loop sees as a request's images: none, so image rows join the batch
    (`tokenize` made their tokens and pixel inputs; `row_caches` gives their rows the features)."""
    return []
