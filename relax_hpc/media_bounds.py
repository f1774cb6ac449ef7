"""The hard bounds on what relax_hpc reads of one image, video or audio clip, whatever the recipe says.

A leaf (standard library only): the readers (:mod:`relax_hpc.multimodal`, :mod:`relax_hpc.audio`) enforce them, and
the recipe's ``data:`` check (:mod:`relax_hpc.rollout.checks`) bounds ``data.max_image_pixels``,
``data.video_max_frames`` and ``data.max_audio_seconds`` by them without loading either reader.
"""

MAX_IMAGE_PIXELS = 64_000_000  # width × height above this is refused before decoding (a decompression bomb)
MAX_VIDEO_FRAMES = 768  # the most frames relax_hpc keeps of one video (Qwen's FPS_MAX_FRAMES), whatever the recipe
MAX_AUDIO_SECONDS = 600.0  # the most relax_hpc reads of one clip, whatever the recipe says
