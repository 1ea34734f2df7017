"""Images in a request: from the wire to the model's input and the prefix cache's key. No wire types.

A door turns each image of its API (a chat ``image_url`` part, a Responses ``input_image``, a Messages ``image``
block) into an ``ImageRef`` with ``image_ref`` / ``base64_ref`` (a malformed data: URI is a 400 there), and puts an
image part (``{"type": "image"}``, the ref under ``IMAGE_KEY``) where the image sits in the message's content
(``parts_content``): chat templates render it as the model's image placeholder. The core
(server.core.prompts.render_media) then, off the event loop:

1. ``decode`` each image with Pillow, within ``ImageLimits`` (images per request, bytes per image, pixels per
   image; an http(s) URL only with ``--allow-image-urls``): each refusal a 400 (413 for too many bytes) naming the
   client's parameter, before any model work;
2. renders the chat template as text and hands text and images to the model's processor (mlx-vlm, through
   models.loading.vision.VisionTower.prepare): the token ids with each image's soft tokens, and the pixel values;
3. builds the prefix cache's key (``cache_key``): the prompt's token ids with each image's soft tokens replaced by
   tokens derived from the image's digest (``key_tokens``: sha256 of the decoded pixels and their size, so the same
   picture re-encoded is the same image). Key tokens lie in ``[KEY_BASE, 2**31)``, above every vocabulary, so no
   text can spell them and a request without the image can never reach KV computed with it; the same image at the
   same place gives the same key (a later turn that resends it hits), a different image parts the key at its first
   soft token. The key is the sequence's prompt everywhere the cache and the lane look (RAM and SSD tiers alike:
   the SSD files carry the same token ids); the model reads the real token ids and the image embeddings
   (``PromptMedia``) in the prefill chunks that hold image tokens (server.engine.prefill).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from server.errors import InvalidRequest, PayloadTooLarge

__all__ = ["ImageRef", "ImageLimits", "DecodedImage", "PromptMedia", "IMAGE_KEY", "KEY_BASE", "image_ref",
           "base64_ref", "parts_content", "decode", "image_spans", "key_tokens", "cache_key"]

KEY_BASE = 1 << 30  # cache-key tokens of images: [KEY_BASE, 2**31), above any vocabulary (SSD files hold < 2**31)
IMAGE_KEY = "mlx_lane_image"  # the ImageRef in an image part of a message's content (templates read "type" only)
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


@dataclass(frozen=True)
class ImageRef:
    """One image of a request, as the client sent it: the file's bytes (a data: URI or base64 source, decoded), or
    an http(s) URL; ``param``: where it was, in the client's own words (errors name it)."""

    data: Optional[bytes] = None
    url: Optional[str] = None
    param: str = "messages"


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts (server flags ``--max-images``, ``--max-image-bytes``, ``--max-image-pixels``,
    ``--allow-image-urls``)."""

    max_images: int = 32
    max_bytes: int = 10 << 20
    max_pixels: int = 1 << 24  # 16.8 Mpx: a 5K screenshot fits
    allow_urls: bool = False
    url_timeout_s: float = 10.0


@dataclass(frozen=True)
class DecodedImage:
    image: Any  # a PIL image, RGB
    digest: bytes  # sha256 of its pixels and size (the cache's identity of the image)


@dataclass(frozen=True)
class PromptMedia:
    """What the model reads at a prompt's images: the real token ids of the whole prompt (the sequence's prompt is
    the cache key, ``cache_key``), where each image's soft tokens are (``spans``: [start, end)), and the
    processor's pixel values (one per image, in order)."""

    input_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    pixel_values: Any  # numpy (images, channels, height, width); Qwen's: (patches of every image, patch size)
    digests: tuple[bytes, ...] = ()
    grid: Any = None  # Qwen's (images, 3) patch grids (t, h, w); None for a family of whole-image pixel values

    def pixels(self, first: int, last: int) -> tuple[Any, Any]:
        """The pixel values of images ``first..last-1`` and their grids (None without grids): rows of whole images,
        or of their patches where a grid says how many each has."""
        if self.grid is None:
            return self.pixel_values[first:last], None
        counts = [int(t) * int(h) * int(w) for t, h, w in self.grid]
        lo, hi = sum(counts[:first]), sum(counts[:last])
        return self.pixel_values[lo:hi], self.grid[first:last]

    def window(self, covered: int) -> Optional[tuple[int, int, int, int]]:
        """The stretch whose embeddings a prefill from ``covered`` needs: ``(start, stop, first, last)`` where
        ``[start, stop)`` holds the images ``first..last-1`` whole (those not entirely below ``covered``) and every
        position from ``covered`` to the last of them; None when every image is below ``covered``."""
        needed = [i for i, (_, end) in enumerate(self.spans) if end > covered]
        if not needed:
            return None
        first, last = needed[0], needed[-1] + 1
        return min(covered, self.spans[first][0]), self.spans[last - 1][1], first, last


def image_ref(url: str, param: str) -> ImageRef:
    """An image given as a URL string (OpenAI's ``image_url.url``, Responses' ``image_url``): a base64 ``data:``
    URI, or an http(s) URL (fetched later, only when the server allows it)."""
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequest("an image data: URI must be 'data:<media type>;base64,<data>'", param=param)
        return base64_ref(payload, param)
    if url.startswith(("http://", "https://")):
        return ImageRef(url=url, param=param)
    raise InvalidRequest("an image URL must be a base64 data: URI or an http(s) URL", param=param)


def base64_ref(payload: str, param: str) -> ImageRef:
    try:
        return ImageRef(data=base64.b64decode(payload, validate=True), param=param)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the image's base64 data is not valid base64", param=param) from None


def parts_content(pieces: Sequence[Union[str, ImageRef]], sep: str = "") -> tuple[Union[str, list], list[ImageRef]]:
    """A message's content from its text pieces and images in order: the joined text when there is no image (what
    the template read before images existed: a text-only conversation renders as it always did), else template
    parts (``{"type": "text", "text"}`` / ``{"type": "image", IMAGE_KEY: ref}``), and the images. ``sep`` joins
    consecutive text pieces. ``GenerationRequest.images`` finds the images again in the messages."""
    images = [p for p in pieces if isinstance(p, ImageRef)]
    if not images:
        return sep.join(pieces), []
    parts: list = []
    for piece in pieces:
        if isinstance(piece, ImageRef):
            parts.append({"type": "image", IMAGE_KEY: piece})
        elif parts and parts[-1].get("type") == "text":
            parts[-1]["text"] += sep + piece
        else:
            parts.append({"type": "text", "text": piece})
    return parts, images


def decode(ref: ImageRef, limits: ImageLimits) -> DecodedImage:
    """Decode one image with Pillow within ``limits``. Raises InvalidRequest (not an image, too many pixels, a URL
    the server does not fetch or could not fetch) or PayloadTooLarge (too many bytes), naming ``ref.param``."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    data = ref.data if ref.url is None else _fetch(ref, limits)
    if len(data) > limits.max_bytes:
        raise PayloadTooLarge(f"the image is {len(data)} bytes; this server takes at most {limits.max_bytes} bytes "
                              "per image (--max-image-bytes)", param=ref.param)
    try:
        img = Image.open(io.BytesIO(data))
        width, height = img.size  # from the header: nothing is decoded yet
        if width * height > limits.max_pixels:
            raise InvalidRequest(f"the image is {width}x{height} pixels; this server takes at most "
                                 f"{limits.max_pixels} pixels per image (--max-image-pixels)", param=ref.param)
        img = ImageOps.exif_transpose(img).convert("RGB")
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"the image could not be decoded: {exc}", param=ref.param) from None
    h = hashlib.sha256(b"rgb\0%d\0%d\0" % img.size)
    h.update(img.tobytes())
    return DecodedImage(img, h.digest())


def _fetch(ref: ImageRef, limits: ImageLimits) -> bytes:
    if not limits.allow_urls:
        raise InvalidRequest("image URLs are not fetched by this server (start it with --allow-image-urls); "
                             "send the image as a base64 data: URI", param=ref.param)
    import httpx

    try:
        with httpx.stream("GET", ref.url, timeout=limits.url_timeout_s, follow_redirects=True) as resp:
            resp.raise_for_status()
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise PayloadTooLarge(f"the image at the URL is over {limits.max_bytes} bytes "
                                          "(--max-image-bytes)", param=ref.param)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"the image URL could not be fetched: {exc}", param=ref.param) from None


def image_spans(input_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """Each run of ``image_token_id`` in ``input_ids`` as [start, end): one per image."""
    spans, start = [], None
    for i, t in enumerate(input_ids):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(input_ids)))
    return spans


def key_tokens(digest: bytes, n: int) -> list[int]:
    """``n`` cache-key tokens of an image: position i is 30 bits of sha256(digest, i), above ``KEY_BASE``."""
    out = []
    for i in range(n):
        word = int.from_bytes(hashlib.sha256(digest + i.to_bytes(4, "little")).digest()[:4], "little")
        out.append(KEY_BASE + (word & (KEY_BASE - 1)))
    return out


def cache_key(input_ids: Sequence[int], spans: Sequence[tuple[int, int]], digests: Sequence[bytes]) -> list[int]:
    """The prompt's cache key: ``input_ids`` with image i's span replaced by ``key_tokens(digests[i], ...)``."""
    key = list(input_ids)
    for (start, end), digest in zip(spans, digests):
        key[start:end] = key_tokens(digest, end - start)
    return key
