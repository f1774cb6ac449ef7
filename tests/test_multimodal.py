"""Reading an image (relax_hpc/multimodal.py): its size is judged from the header before anything is decoded, PIL opens
only the common formats, and no message quotes a byte of what was read (it may be a file a row had no business
naming)."""

from __future__ import annotations

import io
import struct
import zlib

import pytest

from relax_hpc import multimodal
from relax_hpc.media import MediaPolicy

MEGA62 = (7900, 7900)  # 62,410,000 pixels: under MAX_IMAGE_PIXELS, far over any processor's max_pixels


def png(size: tuple[int, int], mode: str = "1") -> bytes:
    """A PNG of one colour; mode "1" keeps even 62 Mpx small to make and to store (~23 kB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 1).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG signature and IHDR claiming ``w`` × ``h`` RGB, then one empty IDAT and IEND: nothing to decode."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_a_file_that_is_not_an_image_is_named_and_never_quoted(tmp_path):
    secret = b"root:$6$CANARYHASH:19000:0:99999:7:::\n"
    (tmp_path / "shadow.png").write_bytes(secret)
    with pytest.raises(multimodal.ImageError) as e:
        multimodal.load_image("shadow.png", MediaPolicy(base_dir=tmp_path))
    msg = str(e.value)
    assert "not an image PIL can read" in msg and f"{len(secret)} bytes" in msg
    assert secret[:8].decode() not in msg and "root" not in msg and "CANARY" not in msg, msg
    # the header of a real format, then garbage: PIL's message would quote the chunk; ours gives its kind only
    damaged = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dCANARYCANARY" + b"\x00" * 20
    with pytest.raises(multimodal.ImageError) as e:
        multimodal.open_image(damaged)
    assert "CANARY" not in str(e.value), e.value


def test_a_62_megapixel_png_is_refused_by_its_header_before_decoding():
    big = png(MEGA62)
    assert len(big) < 100_000  # one colour: small on disk, 187 MB decoded as RGB
    with pytest.raises(multimodal.ImageError, match=r"7900×7900 = 62410000 pixels, over the 12544 pixels an image "
                                                    r"may have \(data.max_image_pixels\)"):
        multimodal.open_image(big, 112 * 112, "an image may have (data.max_image_pixels)")
    # the same header with a cut stream: the budget is what refuses it, so nothing was decoded before the check
    cut = big[:big.index(b"IDAT") + 100]
    with pytest.raises(multimodal.ImageError, match="over the 12544 pixels"):
        multimodal.open_image(cut, 112 * 112)
    with pytest.raises(multimodal.ImageError, match="cannot be decoded"):  # without the budget it gets to decoding
        multimodal.open_image(cut)
    # over the hard bound, and over PIL's own bomb bound (2 × Image.MAX_IMAGE_PIXELS): refused alike, no PIL error
    for w, h in ((9000, 8000), (20000, 10000)):
        with pytest.raises(multimodal.ImageError, match=f"over the {multimodal.MAX_IMAGE_PIXELS} pixels"):
            multimodal.open_image(png_header_only(w, h))


def test_only_the_common_formats_are_opened():
    from PIL import Image

    for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format=fmt)
        assert multimodal.open_image(buf.getvalue()).size == (8, 8), fmt
    for fmt in ("PPM", "ICO", "TGA"):  # PIL reads these, and dozens more; a data row gets the common ones
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format=fmt)
        with pytest.raises(multimodal.ImageError, match="not an image PIL can read"):
            multimodal.open_image(buf.getvalue())


def test_urls_and_other_schemes(tmp_path):
    with pytest.raises(multimodal.ImageError, match="URLs are not fetched. Fix: set data.allow_media_urls"):
        multimodal.image_bytes("https://example.com/cat.png", MediaPolicy(base_dir=tmp_path))
    with pytest.raises(multimodal.ImageError, match="a file:// URL"):
        multimodal.image_bytes("file:///etc/passwd", MediaPolicy(base_dir=tmp_path, allow_urls=True))
    with pytest.raises(multimodal.ImageError, match="URLs are not fetched"):  # a trusted caller fetches none either
        multimodal.image_bytes("http://127.0.0.1:1/x.png")


def test_default_pixel_budgets_are_the_processors(tiny_vlm):
    assert multimodal.processor_max_pixels(tiny_vlm) == 112 * 112
    assert multimodal.pixel_budgets(tiny_vlm, None, None) == (112 * 112, multimodal.PROMPT_IMAGES * 112 * 112)
    assert multimodal.pixel_budgets(tiny_vlm, 10 ** 9, 7) == (multimodal.MAX_IMAGE_PIXELS, 7)
