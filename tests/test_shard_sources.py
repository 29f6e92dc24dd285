"""Input forms: Hugging Face style Parquet (embedded media, JSON-string conversations, renamed
columns, row-group streaming), NeMo speech manifests, JSON(L) with a leading BOM, and media
named in transformers' chat content parts."""

from __future__ import annotations

import codecs
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mimo_data.shards.format import TEXT_PART_BREAK
from mimo_data.shards.records import RecordError, normalize_messages

from conftest import (all_samples, build_dataset, chat, cli_main, origin_of, read_json,
                      sample_records, samples_table, write_json, write_jsonl)

MEDIA = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def _samples_by_id(directory) -> dict[str, tuple[dict, dict[str, bytes]]]:
    out = {}
    for _, _, members in all_samples(directory):
        record = json.loads(members["json"])
        out[record["id"]] = (record, members)
    return out


def _media(record, members, modality) -> list[bytes]:
    return [members[m["member"]] for m in record["media"] if m["modality"] == modality]


def test_parquet_embedded_bytes_win_over_paths(tmp_path, assets):
    jpeg, png = assets["jpeg"].read_bytes(), assets["png"].read_bytes()
    (tmp_path / "pics").mkdir()
    shutil.copy(assets["png"], tmp_path / "pics" / "on-disk.png")
    table = pa.table({
        "id": ["embedded", "by-path", "both"],
        "images": pa.array([
            [{"bytes": jpeg, "path": "no/such/file.jpg"}],       # bytes only count
            [{"bytes": None, "path": "pics/on-disk.png"}],       # relative to the table's folder
            [{"bytes": png, "path": None}, {"bytes": jpeg, "path": "x.jpg"}],
        ], pa.list_(MEDIA)),
        "messages": pa.array([
            [{"role": "user", "content": "<image>\nWhat is it?"},
             {"role": "assistant", "content": "A photo."}],
            [{"role": "user", "content": "Describe <image>"},
             {"role": "assistant", "content": "Text."}],
            [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "<image> vs <image>?"},
             {"role": "assistant", "content": "Different."}],
        ], pa.list_(MESSAGE)),
    })
    path = tmp_path / "table.parquet"
    pq.write_table(table, path)
    build_dataset([path], tmp_path / "out")

    report = read_json(tmp_path / "out" / "report.json")
    assert report["samples_written"] == 3 and report["records_skipped"] == 0
    samples = _samples_by_id(tmp_path / "out")
    assert _media(*samples["embedded"], "image") == [jpeg]
    assert _media(*samples["by-path"], "image") == [png]
    assert _media(*samples["both"], "image") == [png, jpeg]
    record, _ = samples["both"]
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
    assert record["source"] == {"file": str(path), "row": 2}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_null_or_blank_media_value_is_no_item(capsys, tmp_path, assets, suffix):
    """Tables and ``datasets.to_json`` write every column in every row: a null ``images``
    beside an ``image`` (single- and multi-image sets mixed) is not taken for "no image", and
    a blank ``image`` of a text-only row is no item. A row whose image is in a column mimo
    does not read (``image_bytes``) is refused, naming the flag that reads it; an image URL
    kept as metadata, an ``image_path`` beside content parts that name the image, or a
    ``video_path`` beside a frame's image, is no such column."""
    jpeg, png = str(assets["jpeg"]), str(assets["png"])
    rows = {"id": ["single", "list", "text", "holes"],
            "images": [None, [png], [], [None, png, ""]], "image": [jpeg, "", "", ""],
            "image_url": ["https://example.com/a.jpg"] * 4,
            "conversations": [chat(q, "A.") for q in ("<image>\nWhat?", "<image> and?", "Hi?",
                                                      "<image> here?")]}
    path = tmp_path / f"mixed{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, [dict(zip(rows, values)) for values in zip(*rows.values())])
    else:
        turn = pa.struct([("from", pa.string()), ("value", pa.string())])
        pq.write_table(pa.table({**rows, "images": pa.array(rows["images"], pa.list_(
            pa.string())), "conversations": pa.array(rows["conversations"], pa.list_(turn))}),
            path)
    build_dataset([path], tmp_path / "out")
    assert read_json(tmp_path / "out" / "report.json")["records_skipped"] == 0
    samples = _samples_by_id(tmp_path / "out")
    assert _media(*samples["single"], "image") == [assets["jpeg"].read_bytes()]
    assert _media(*samples["list"], "image") == [assets["png"].read_bytes()]
    assert _media(*samples["text"], "image") == []
    assert _media(*samples["holes"], "image") == [assets["png"].read_bytes()]   # nulls: none
    if suffix == ".jsonl":
        # bytes in JSON: base64 (line-wrapped too), as an exported table's struct holds them
        import base64
        encoded = write_jsonl(tmp_path / "b64.jsonl", [{
            "id": "b64", "images": [{"bytes": base64.encodebytes(assets["jpeg"].read_bytes())
                                     .decode(), "path": None}],
            "conversations": chat("<image>\nWhat?", "A.")}, {
            "id": "bad", "images": [{"bytes": "not base64!", "path": None}],
            "conversations": chat("<image>\nWhat?", "A.")}, {
            # ms-swift's image as base64 text alone ("/9j/4AAQ...": no path, no data: URL)
            "id": "swift", "images": [base64.b64encode(assets["png"].read_bytes()).decode()],
            "messages": [{"role": "user", "content": "<image>What?"},
                         {"role": "assistant", "content": "A."}]}, {
            # a long path without an extension, in base64's letters: a file there is read
            "id": "long", "images": ["photos2023/" * 25 + "IMG000001"],
            "conversations": chat("<image>\nWhat?", "A.")}])
        (tmp_path / ("photos2023/" * 25)).mkdir(parents=True)
        shutil.copy(assets["jpeg"], tmp_path / ("photos2023/" * 25 + "IMG000001"))
        code, _, err = cli_main(capsys, "build", encoded, "-o", tmp_path / "b64", "--no-progress")
        b64 = _samples_by_id(tmp_path / "b64")
        assert code == 0 and _media(*b64["b64"], "image") == [assets["jpeg"].read_bytes()]
        assert _media(*b64["swift"], "image") == [assets["png"].read_bytes()]
        assert _media(*b64["long"], "image") == [assets["jpeg"].read_bytes()]
        bad = read_json(tmp_path / "b64" / "report.json")["skipped_by_reason"]["malformed_record"]
        assert bad["first"][0]["detail"] == "media bytes 'not base64!', a string (how JSON " \
            "holds bytes: give base64, or a path), is not valid base64", bad
        # a source clip's path kept beside the record's image: metadata, not an unread video
        kept = write_jsonl(tmp_path / "frames.jsonl", [{
            "id": "frame", "image": jpeg, "video_path": "raw/clip.mp4",
            "conversations": chat("<image>\nWhat happens?", "A.")}])
        build_dataset([kept], tmp_path / "frames")
        assert _media(*_samples_by_id(tmp_path / "frames")["frame"], "image") == [
            assets["jpeg"].read_bytes()]
    if suffix == ".parquet":
        unread = tmp_path / "unread.parquet"
        pq.write_table(pa.table({"image_bytes": [assets["jpeg"].read_bytes()],
                                 "conversations": pa.array([chat("<image>Hm?", "A.")],
                                                           pa.list_(turn))}), unread)
        code, _, err = cli_main(capsys, "build", unread, "-o", tmp_path / "no", "--no-progress")
        skipped = read_json(tmp_path / "no" / "report.json")["skipped_by_reason"]
        assert code == 1 and skipped["malformed_record"]["first"][0]["detail"] == (
            "the record names its image under 'image_bytes', which mimo does not read: read "
            "that column with --image-column image_bytes")
        code, _, err = cli_main(capsys, "build", unread, "-o", tmp_path / "yes", "--no-progress",
                                "--image-column", "image_bytes")
        assert code == 0, err


def test_parquet_json_string_conversation(tmp_path, assets):
    flac = assets["flac"].read_bytes()
    turns = chat("<audio>\nWhat is said?", "Hello there.")
    table = pa.table({
        "id": ["s1", "s2"],
        "audio": pa.array([{"bytes": flac, "path": "clip.flac"}, None], MEDIA),
        "conversations": [json.dumps(turns), json.dumps(chat("Just text?", "Yes."))],
    })
    path = tmp_path / "speech.parquet"
    pq.write_table(table, path)
    build_dataset([path], tmp_path / "out")

    samples = _samples_by_id(tmp_path / "out")
    record, members = samples["s1"]
    assert record["messages"] == [{"role": "user", "content": "<audio>\nWhat is said?"},
                                  {"role": "assistant", "content": "Hello there."}]
    assert _media(record, members, "audio") == [flac]
    record, members = samples["s2"]
    assert record["media"] == [] and set(members) == {"json"}
    assert record["messages"][1] == {"role": "assistant", "content": "Yes."}


@pytest.mark.parametrize("column", ["tools", "functions"])
def test_a_parquet_tools_column_is_the_conversations_tools(tmp_path, column):
    """A conversations table with a ``tools`` (or OpenAI's older ``functions``) column,
    function-calling sets storing it as JSON text: a row listing tools has them on its first
    message, wrapped as chat templates take them; one with ``"[]"`` or null has none. A
    ``system`` column's prompt is the first turn where it has one."""
    function = {"name": "get_weather", "parameters": {"type": "object"}}
    table = pa.table({"id": ["listed", "empty", "null"],
                      column: [json.dumps([function]), "[]", None],
                      "system": ["Use tools.", None, ""],
                      "conversations": [json.dumps(chat("Weather?", "Sunny."))] * 3})
    path = tmp_path / "calls.parquet"
    pq.write_table(table, path)
    build_dataset([path], tmp_path / "out")
    samples = {key: record for key, (record, _) in _samples_by_id(tmp_path / "out").items()}
    assert set(samples) == {"listed", "empty", "null"}
    assert samples["listed"]["messages"][0] == {   # a system column: the prompt first
        "role": "system", "content": "Use tools.", "tools": [{"type": "function",
                                                              "function": function}]}
    for key in ("empty", "null"):
        assert samples[key]["messages"][0] == {"role": "user", "content": "Weather?"}


def test_a_parquet_objects_column_of_grounding_is_refused(tmp_path):
    """ms-swift's grounding ``objects`` in a table (a struct column, the rows without boxes
    holding empty lists or null): a row with objects for its ``<ref-object>`` / ``<bbox>``
    placeholders is a counted malformed_record (mimo would train them as text); the others,
    and objects no placeholder names (a detection set's labels), are kept."""
    objects = pa.array([{"ref": ["a dog"], "bbox": [[331.5, 761.4, 853.5, 1594.8]]},
                        {"ref": [], "bbox": []}, None,
                        {"ref": ["a dog"], "bbox": [[1.0, 2.0, 3.0, 4.0]]}],
                       pa.struct([("ref", pa.list_(pa.string())),
                                  ("bbox", pa.list_(pa.list_(pa.float64())))]))
    table = pa.table({"id": ["grounded", "empty", "null", "labels"], "objects": objects,
                      "messages": [json.dumps(chat("Find it.", "<ref-object><bbox>"))]
                      + [json.dumps(chat("Hi?", "Hello."))] * 3})
    path = tmp_path / "grounding.parquet"
    pq.write_table(table, path)
    build_dataset([path], tmp_path / "out")
    report = read_json(tmp_path / "out" / "report.json")
    assert report["samples_written"] == 3
    [first] = report["skipped_by_reason"]["malformed_record"]["first"]
    assert first["location"] == f"{path}#0" and "grounding 'objects'" in first["detail"]


def test_parquet_struct_calls_and_tools_keep_their_own_fields(tmp_path):
    """Calls and tools in nested columns (list<struct>): Arrow gives every row one struct
    type, each row's values holding the other rows' fields as nulls; a call or tool keeps only
    its own (the model would learn to write the others' as its arguments)."""
    def conversation(name, arguments):
        return [{"role": "user", "content": "Go?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Done."}]
    tools = [[{"type": "function", "function": {"name": "weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}],
             [{"type": "function", "function": {"name": "count", "description": "Counts.",
                                                 "parameters": {"type": "object"}}}]]
    table = pa.table({"id": ["one", "two"], "tools": tools,
                      "messages": [conversation("weather", {"city": "Oslo"}),
                                   conversation("count", {"n": 3})]})
    assert pa.types.is_struct(table.schema.field("tools").type.value_type)
    path = tmp_path / "calls.parquet"
    pq.write_table(table, path)
    build_dataset([path], tmp_path / "out")
    samples = {key: record for key, (record, _) in _samples_by_id(tmp_path / "out").items()}
    for key, name, arguments, tool in (("one", "weather", {"city": "Oslo"}, tools[0]),
                                       ("two", "count", {"n": 3}, tools[1])):
        first, call = samples[key]["messages"][0], samples[key]["messages"][1]
        assert first["tools"] == tool, first
        assert call == {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]}, call


def test_a_parquet_input_that_is_not_one_is_a_usage_error_naming_it(capsys, tmp_path):
    """A damaged, empty or mislabelled Parquet input: exit 2 naming the file, not pyarrow's
    traceback; a JSON Lines file read as Parquet is told its --input-format."""
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 not a whole file\n")
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "chat.jsonl").write_text('{"id": "a", "conversations": []}\n')
    for name, said in (("cut.parquet", "Parquet magic bytes not found"),
                       ("empty.parquet", "Parquet file size is 0 bytes")):
        code, _, err = cli_main(capsys, "build", tmp_path / name, "-o", tmp_path / "out",
                                "--no-progress")
        assert code == 2 and f"{tmp_path / name}: not a readable Parquet file ({said}" in err
        assert "Traceback" not in err and not (tmp_path / "out").exists()
    code, _, err = cli_main(capsys, "build", tmp_path / "chat.jsonl", "-o", tmp_path / "out",
                            "--no-progress", "--input-format", "parquet")
    assert code == 2 and "is read with --input-format llava or manifest" in err, err


def test_parquet_column_flags(capsys, tmp_path, assets):
    jpeg, wav = assets["jpeg"].read_bytes(), assets["wav"].read_bytes()
    table = pa.table({
        "uid": ["r0", "r1"],
        "dialog": pa.array([
            [{"role": "user", "content": "<image><audio>"}, {"role": "assistant", "content": "A."}],
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "B."}],
        ], pa.list_(MESSAGE)),
        "pics": pa.array([[{"bytes": jpeg, "path": None}], []], pa.list_(MEDIA)),
        "clips": pa.array([[{"bytes": wav, "path": None}], []], pa.list_(MEDIA)),
        "id": ["ignored-0", "ignored-1"],
    })
    path = tmp_path / "renamed.parquet"
    pq.write_table(table, path)

    # Without the flags the conversation column cannot be found: the whole input is refused.
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "refused", "--no-progress")
    assert code == 2 and "(columns are clips, dialog, id, pics, uid): name the " \
        "column holding them with --messages-column, --texts-column or --caption-column; " \
        "another form (question/answer" in err, err
    assert not (tmp_path / "refused").exists()

    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress",
                            "--id-column", "uid", "--messages-column", "dialog",
                            "--image-column", "pics", "--audio-column", "clips")
    assert code == 0, err
    samples = _samples_by_id(tmp_path / "out")
    assert sorted(samples) == ["r0", "r1"]
    record, members = samples["r0"]
    assert [m["modality"] for m in record["media"]] == ["image", "audio"]
    assert _media(record, members, "image") == [jpeg]
    assert _media(record, members, "audio") == [wav]
    assert record["messages"][0] == {"role": "user", "content": "<image><audio>"}

    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "missing", "--no-progress",
                            "--messages-column", "no_such_column")
    assert code == 2 and "no_such_column" in err
    # a column flag with no table among the inputs: refused, never silently unused
    lines = write_jsonl(tmp_path / "records.jsonl", [{"uid": "r0", "conversations": chat(
        "Hi?", "Hello.")}])
    code, _, err = cli_main(capsys, "build", lines, "-o", tmp_path / "jsonl", "--no-progress",
                            "--id-column", "uid")
    assert code == 2 and "no input is one" in err, err


def test_a_decoded_audio_column_trains_its_samples_not_its_path(capsys, tmp_path, assets):
    """A table saved after ``datasets`` decoded (and cut) its audio, ``{array, sampling_rate,
    path}`` with the path still naming the whole file: the array's samples are stored (a
    float WAV), not the file; channels first (``mono=False``) are channels; what would be
    guessed at (no rate, integers, samples far outside [-1, 1], NaN) is refused saying what
    to give."""
    import io

    import numpy as np
    import soundfile

    whole, rate = soundfile.read(assets["wav"], dtype="float32")
    assert whole.ndim == 1 and len(whole) > rate
    cut = whole[:rate // 2]                             # its first half second, by a map()
    stereo = np.stack([cut, -cut])

    def table(rows, array_type):
        decoded = pa.struct([("array", array_type), ("sampling_rate", pa.float64()),
                             ("path", pa.string())])
        return pa.table({"id": [r[0] for r in rows], "sentence": ["words"] * len(rows),
                         "audio": pa.array([{"array": r[1], "sampling_rate": r[2],
                                             "path": str(assets["wav"])} for r in rows],
                                           decoded)})
    tables = {
        "floats": table([("cut", cut.tolist(), float(rate)), ("no-rate", cut.tolist(), 3e9),
                         ("nan", [float("nan")] * 100, float(rate)),
                         ("int-scaled", (cut * 32768).tolist(), float(rate))],
                        pa.list_(pa.float32())),
        "ints": table([("ints", (cut * 32768).astype(int).tolist(), float(rate))],
                      pa.list_(pa.int64())),
        "stereo": table([("stereo", stereo.tolist(), float(rate))],
                        pa.list_(pa.list_(pa.float32())))}
    for name, data in tables.items():
        pq.write_table(data, tmp_path / f"{name}.parquet")
    code, _, err = cli_main(capsys, "build", *(tmp_path / f"{n}.parquet" for n in tables),
                            "-o", tmp_path / "out", "--no-progress", "--caption-column",
                            "sentence")
    assert code == 0, err
    written = _samples_by_id(tmp_path / "out")
    assert sorted(written) == ["cut", "stereo"]
    for key, expected in (("cut", cut[:, None]), ("stereo", stereo.T)):
        [stored] = _media(*written[key], "audio")
        samples, stored_rate = soundfile.read(io.BytesIO(stored), dtype="float32",
                                              always_2d=True)
        assert stored_rate == rate and samples.tolist() == expected.tolist(), key
    skipped = {entry["location"].rsplit("/", 1)[-1]: entry["detail"] for entry in read_json(
        tmp_path / "out" / "report.json")["skipped_by_reason"]["malformed_record"]["first"]}
    assert "a decoded audio array with sampling_rate 3000000000.0: give its rate in Hz beside " \
        "it" in skipped["floats.parquet#1"], skipped
    assert "a decoded audio array whose samples reach nan: give float samples in [-1, 1]" in \
        skipped["floats.parquet#2"], skipped
    assert "a decoded audio array whose samples reach " in skipped["floats.parquet#3"], skipped
    assert "a decoded audio array of integers: give float samples in [-1, 1] (16-bit PCM " \
        "divided by 32768)" in skipped["ints.parquet#0"], skipped


def test_a_hub_speech_table_is_told_which_flags_read_it(capsys, tmp_path, assets):
    """A FLEURS-shaped table (``id`` per sentence, shared by its speakers' recordings; the
    audio as ``{bytes, path}``; ``transcription``): without flags the build names
    ``--caption-column transcription``; with it, a repeated id's detail names
    ``--id-column``; with both, every recording is a caption pair of its own bytes."""
    wav, flac = assets["wav"].read_bytes(), assets["flac"].read_bytes()
    table = pa.table({"id": [1906, 1906], "path": ["a.wav", "b.flac"],
                      "audio": pa.array([{"bytes": wav, "path": "a.wav"},
                                         {"bytes": flac, "path": "b.flac"}], MEDIA),
                      "transcription": ["the same sentence"] * 2, "gender": [0, 1]})
    path = tmp_path / "fleurs.parquet"
    pq.write_table(table, path)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "refused", "--no-progress")
    assert code == 2 and "--caption-column transcription" in err, err
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "asked", "--no-progress",
                            "--caption-column", "transcription", "--instruction", "Write it.")
    assert code == 2 and "no input is one" in err, err        # never silently unused
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "one", "--no-progress",
                            "--caption-column", "transcription")
    assert code == 0, err
    [skip] = read_json(tmp_path / "one" / "report.json")["skipped_by_reason"]["duplicate_id"][
        "first"]
    assert "--id-column" in skip["detail"], skip
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress",
                            "--caption-column", "transcription", "--id-column", "path")
    assert code == 0, err
    # its media under a column no modality is named by: refused naming the flag, not every
    # row skipped as "a caption pair has exactly one media item, this record 0"
    pq.write_table(table.rename_columns(["id", "path", "recording", "transcription",
                                         "gender"]), tmp_path / "renamed.parquet")
    code, _, err = cli_main(capsys, "build", tmp_path / "renamed.parquet", "-o",
                            tmp_path / "renamed", "--no-progress", "--caption-column",
                            "transcription")
    assert code == 2 and "caption pairs (column 'transcription') and no column of their " \
        "media found (columns are gender, id, path, recording, transcription): " \
        "name it with --image-column (or --audio-column" in err, err
    # a row whose audio is null: skipped, saying which field is empty and what to do
    pq.write_table(pa.concat_tables([table, pa.table({
        "id": [1907], "path": ["c.wav"], "audio": pa.array([None], MEDIA),
        "transcription": ["no clip"], "gender": [0]}).cast(table.schema)]),
        tmp_path / "null.parquet")
    code, _, err = cli_main(capsys, "build", tmp_path / "null.parquet", "-o",
                            tmp_path / "null", "--no-progress", "--caption-column",
                            "transcription", "--id-column", "path")
    [skip] = read_json(tmp_path / "null" / "report.json")["skipped_by_reason"][
        "malformed_record"]["first"]
    assert code == 0 and skip["detail"] == "the caption pair has no media item (its 'audio' " \
        "null or empty): a caption goes with one image, audio clip or video; give the record " \
        "its item, or leave the record out", skip
    samples = _samples_by_id(tmp_path / "out")
    assert sorted(samples) == ["a.wav", "b.flac"]
    for key, data in (("a.wav", wav), ("b.flac", flac)):
        record, members = samples[key]
        assert record["kind"] == "caption" and record["text"] == "the same sentence"
        assert _media(record, members, "audio") == [data]


def test_parquet_bad_row_is_reported_by_row_number(tmp_path, assets):
    png = assets["png"].read_bytes()
    bad_row = 5
    rows = 7
    images = [[{"bytes": png, "path": f"p{i}.png"}] for i in range(rows)]
    images[bad_row] = [{"bytes": png[: len(png) // 2], "path": "truncated.png"}]
    table = pa.table({
        "id": [f"row-{i}" for i in range(rows)],
        "images": pa.array(images, pa.list_(MEDIA)),
        "conversations": [json.dumps(chat(f"<image>\nImage {i}?", f"Answer {i}."))
                          for i in range(rows)],
    })
    path = tmp_path / "grouped.parquet"
    pq.write_table(table, path, row_group_size=2)
    assert pq.ParquetFile(path).metadata.num_row_groups == 4

    build_dataset([path], tmp_path / "out")
    report = read_json(tmp_path / "out" / "report.json")
    assert report["records_read"] == rows == report["samples_written"] + report["records_skipped"]
    assert list(report["skipped_by_reason"]) == ["corrupt_image"]
    entry = report["skipped_by_reason"]["corrupt_image"]
    assert entry["count"] == 1
    assert [f["location"] for f in entry["first"]] == [f"{path}#{bad_row}"]
    written = samples_table(tmp_path / "out")
    assert [r["id"] for r in written] == [f"row-{i}" for i in range(rows) if i != bad_row]
    assert [r["source"] for r in written] == [f"{path}#{i}" for i in range(rows) if i != bad_row]
    # every good row kept its own conversation (no row-group mix-up)
    for record, _ in _samples_by_id(tmp_path / "out").values():
        i = int(record["id"].split("-")[1])
        assert record["source"] == {"file": str(path), "row": i}
        assert record["messages"][1]["content"] == f"Answer {i}."
    # a messages column of numbers, or of one object a row: each row refused naming the
    # column and what it holds (it was "the conversation is missing or empty")
    for name, column in (("numbers", pa.array([1, 2])),
                         ("objects", pa.array([{"role": "user", "content": "Hi"}] * 2))):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"id": [f"{name}-0", f"{name}-1"], "messages": column}), path)
        assert build_dataset([path], tmp_path / name)["totals"]["samples"] == 0
        first = read_json(tmp_path / name / "report.json")["skipped_by_reason"][
            "malformed_record"]["first"][0]
        held = "1 (type number)" if name == "numbers" else \
            "{'role': 'user', 'content': 'Hi'} (type object)"
        assert first["detail"] == f"its column 'messages' holds {held}, not a list of turns " \
            "(role/content or from/value objects)", first
    # the table written out as JSON lines (pandas' to_json): its JSON text read as the turns;
    # text that opens a list but is no JSON refused as such
    write_jsonl(tmp_path / "exported.jsonl", [
        {"id": "text", "image": str(assets["png"]),
         "conversations": json.dumps(chat("<image>\nImage?", "Answer."))},
        {"id": "broken", "conversations": '[{"from": "human", "value": "Hi"'},
        {"id": "pair", "conversations": json.dumps([{"from": "human", "value": "Hi?"}]),
         "chosen": {"from": "gpt", "value": "Hello."},
         "rejected": {"from": "gpt", "value": "Go."}}])
    build_dataset([tmp_path / "exported.jsonl"], tmp_path / "exported")
    [(record, _)] = _samples_by_id(tmp_path / "exported").values()
    assert [(m["role"], m["content"]) for m in record["messages"]] == [
        ("user", "<image>\nImage?"), ("assistant", "Answer.")]
    [broken] = read_json(tmp_path / "exported" / "report.json")["skipped_by_reason"][
        "malformed_json"]["first"]
    assert broken["detail"].startswith("its 'conversations' holds a string that opens a JSON "
                                       "list but is no valid JSON ("), broken
    # as JSON text too, a preference pair's conversation is refused as such, not trained
    [pair] = read_json(tmp_path / "exported" / "report.json")["skipped_by_reason"][
        "malformed_record"]["first"]
    assert pair["detail"].startswith("'chosen' and 'rejected' beside a conversation"), pair


def _manifest_lines(corpus):
    return [json.loads(line) for line in
            (corpus / "speech_manifest.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("instruction", [None, "Write down what the speaker says."])
def test_speech_manifest_lines_become_asr_samples(capsys, tmp_path, corpus, instruction):
    manifest = corpus / "speech_manifest.jsonl"
    extra = ["--instruction", instruction] if instruction else []
    code, _, err = cli_main(capsys, "build", manifest, "-o", tmp_path / "out", "--no-progress",
                            *extra)
    assert code == 0, err
    lines = _manifest_lines(corpus)
    samples = [json.loads(m["json"]) | {"_audio": m} for _, _, m in all_samples(tmp_path / "out")]
    assert len(samples) == len(lines)
    prompt = instruction or "Transcribe the audio."
    for sample in samples:
        _, kind, number = origin_of(sample)
        assert kind == "line"
        line = lines[number - 1]
        assert sample["messages"] == [{"role": "user", "content": f"<audio>\n{prompt}"},
                                      {"role": "assistant", "content": line["text"]}]
        [item] = sample["media"]
        assert item["modality"] == "audio"
        assert sample["_audio"][item["member"]] == (corpus / line["audio_filepath"]).read_bytes()
        assert item["duration"] == pytest.approx(line["duration"], abs=0.01)


def test_a_record_of_no_form_mimo_reads_says_what_it_is(tmp_path, corpus):
    """A speech manifest saved as one JSON list (not NeMo's JSONL) is named as such; a record
    of another form lists its keys and the forms mimo reads."""
    line = _manifest_lines(corpus)[0]
    records = [{"id": "chat", "conversations": [{"from": "human", "value": "Hi."},
                                               {"from": "gpt", "value": "Hello."}]},
               {**line, "audio_filepath": str(corpus / line["audio_filepath"])},
               {"instruction": "Add.", "input": "1+1", "output": "2"}, None,
               # Common Voice's form: a clip and its transcript
               {"audio": str(corpus / line["audio_filepath"]), "sentence": line["text"]},
               # LibriSpeech's (and most speech datasets'): its transcript under 'text'
               {"audio": str(corpus / line["audio_filepath"]), "text": line["text"]}]
    (tmp_path / "mixed.json").write_text(json.dumps(records))
    build_dataset([tmp_path / "mixed.json"], tmp_path / "out")
    details = [entry["detail"] for entry in read_json(tmp_path / "out" / "report.json")[
        "skipped_by_reason"]["malformed_record"]["first"]]
    assert details[0].startswith("a speech manifest's record (audio_filepath) read as a "
                                 "conversation (in a JSON list, among conversations, or with "
                                 "--input-format llava): a manifest is a JSONL file of such "
                                 "records alone")
    assert details[1].startswith("no conversation: the record has the keys 'input', "
                                 "'instruction', 'output', and mimo reads 'messages' or")
    assert details[1].endswith("a 'texts' document or MMC4's 'text_list' and 'image_info': "
                               "convert other forms first (alpaca's instruction/input/output, "
                               "query/response, video QA's q/a)"), details[1]
    assert details[2] == (
        "no conversation: a speech record, its audio and its transcript under 'sentence' "
        "(Common Voice's, a datasets to_json's form): give the transcript as 'caption' (a "
        "caption pair: the model hears the audio, writes the text), e.g. jq -c '. + {caption: "
        ".sentence} | del(.sentence)' FILE > pairs.jsonl, or write a NeMo manifest "
        "(audio_filepath, duration, text)")
    assert details[3].startswith("no conversation: a speech record, its audio and its "
                                 "transcript under 'text' ("), details[3]
    (null,) = read_json(tmp_path / "out" / "report.json")["skipped_by_reason"][
        "malformed_json"]["first"]
    assert null["detail"] == "record is a JSON null, expected an object", null


@pytest.mark.parametrize("name", ["manifest.jsonl", "train_manifest.json"])
def test_speech_manifest_duration_must_match_the_file(tmp_path, corpus, name):
    """A ``duration`` off the file's by more than max(0.1 s, 2 %) is a segment of the file:
    refused by line (mimo does not cut segments). A WAV cut short is refused before its
    duration is compared (its data chunk states more than follow). A manifest named ``.json``
    (NeMo's recipes) is still JSONL; a malformed first line does not make the rest LLaVA. An
    empty file given a duration of 0 is ``empty_audio``, naming the file."""
    line = _manifest_lines(corpus)[0]
    clip, seconds = str(corpus / line["audio_filepath"]), line["duration"]
    assert clip.endswith(".wav") and seconds > 5
    data = (corpus / line["audio_filepath"]).read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[: len(data) // 2])   # half the clip decodes
    records = [
        {"id": "exact", "audio_filepath": clip, "duration": seconds, "text": "kept"},
        {"id": "rounded", "audio_filepath": clip, "duration": seconds + 0.09, "text": "kept"},
        {"id": "no-duration", "audio_filepath": clip, "text": "kept"},
        {"id": "segment", "audio_filepath": clip, "duration": 2.0, "text": "two seconds"},
        {"id": "truncated", "audio_filepath": "cut.wav", "duration": seconds, "text": "whole"},
        {"id": "text-duration", "audio_filepath": clip, "duration": "7.1", "text": "bad"},
        {"id": "pred", "audio_filepath": clip, "duration": seconds, "pred_text": "asr's"},
        # an empty file, whose length manifest writers give as 0: said by its probe
        {"id": "empty", "audio_filepath": "empty.wav", "duration": 0.0, "text": "none"},
        {"id": "zero", "audio_filepath": clip, "duration": 0, "text": "unknown length"},
        # a transcript holding a marker: said of the transcript, not of turns it has not
        {"id": "marker", "audio_filepath": clip, "duration": seconds, "text": "an <audio> tag"},
        # NeMo's segment start: 0 is the whole file; a string of it a mistake said as one
        {"id": "offset-0", "audio_filepath": clip, "offset": 0, "text": "kept"},
        {"id": "offset-text", "audio_filepath": clip, "offset": "0", "text": "bad"},
        {"id": "offset-1", "audio_filepath": clip, "offset": 1.5, "text": "a segment"},
    ]
    (tmp_path / "empty.wav").write_bytes(b"")
    # a .json manifest is known as JSONL by its first line: only a .jsonl may start broken
    broken = [b'{"audio_filepath": "x.wav", "text": "cut'] if name.endswith(".jsonl") else []
    path = write_jsonl(tmp_path / name, broken + records)
    build_dataset([path], tmp_path / "out")

    report = read_json(tmp_path / "out" / "report.json")
    written = _samples_by_id(tmp_path / "out")
    assert sorted(written) == ["exact", "no-duration", "offset-0", "rounded"]
    assert all(r["messages"][1]["content"] == "kept" for r, _ in written.values())
    skipped = {reason: [(f["location"], f["detail"]) for f in entry["first"]]
               for reason, entry in report["skipped_by_reason"].items()}
    first = len(broken) + 1   # the line of records[0]
    [segment, zero] = skipped.pop("duration_mismatch")
    assert zero == (f"{path}:{first + 8}", f"audio 0 ({clip}): the manifest's 'duration' is 0 "
                    f"but the file holds {seconds:g} s: give its length, or leave the field out")
    [truncated] = skipped.pop("corrupt_audio")
    assert (segment[0], truncated[0]) == (f"{path}:{first + 3}", f"{path}:{first + 4}")
    assert f"'duration' is 2 s but the file holds {seconds:g} s" in segment[1]
    assert "cut each segment into a file of its own" in segment[1]
    assert "its data chunk states" in truncated[1] and "a shorter clip" in truncated[1]
    [(location, detail), (pred, named), (text_offset, said), (segment_offset, segmented)] = \
        skipped.pop("malformed_record")
    assert location == f"{path}:{first + 5}" and f"'duration' of {clip} is '7.1'" in detail
    assert text_offset == f"{path}:{first + 11}" and said == f"'offset' of {clip} is '0': give " \
        "where the segment starts in seconds (0 for the whole file), or leave the field out"
    assert segment_offset == f"{path}:{first + 12}" and "non-zero 'offset'" in segmented
    [(location, detail)] = skipped.pop("empty_audio")
    assert location == f"{path}:{first + 7}" and \
        detail == "audio 0 (empty.wav): empty audio file (0 bytes)", detail
    assert pred == f"{path}:{first + 6}" and "this one has {'id': 'str', 'audio_filepath': " \
        "'str', 'duration': 'float', 'pred_text': 'str'}, no string 'text' (under another " \
        "key? rename it)" in named, named
    assert [location for location, _ in skipped.pop("malformed_json", [])] == (
        [f"{path}:1"] if broken else [])
    assert skipped.pop("marker_mismatch") == [(
        f"{path}:{first + 9}", "the transcript ('text') holds <audio>, which marks a medium's "
        "place: reword it (a transcript is the answer the model writes)")]
    assert skipped == {}


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_leading_bom_is_not_part_of_the_first_record(tmp_path, good_records, suffix):
    write = write_jsonl if suffix == ".jsonl" else write_json
    path = write(tmp_path / f"input{suffix}", good_records)
    path.write_bytes(codecs.BOM_UTF8 + path.read_bytes())    # as Windows editors save UTF-8
    build_dataset([path], tmp_path / "out")

    report = read_json(tmp_path / "out" / "report.json")
    assert report["records_skipped"] == 0, report["skipped_by_reason"]
    origins = [origin_of(record) for record in sample_records(tmp_path / "out")]
    kind, first = ("line", 1) if suffix == ".jsonl" else ("index", 0)
    assert origins == [(str(path), kind, first + i) for i in range(len(good_records))]


def test_input_names_as_downloads_give_them(tmp_path, good_records, capsys):
    """Upper-case suffixes and ``.ndjson`` are read as their format; a quoted glob (a hub
    download's shards) is the files it matches, in order; a compressed file is refused by
    its content, whatever its name or --input-format, saying how to decompress it."""
    import gzip
    half = len(good_records) // 2
    (tmp_path / "parts").mkdir()
    write_jsonl(tmp_path / "parts" / "TRAIN-0.JSONL", good_records[:half])
    write_jsonl(tmp_path / "parts" / "train-1.ndjson", good_records[half:])
    (tmp_path / "parts" / "earlier-output").mkdir()          # a folder it matches: not input
    code, _, err = cli_main(capsys, "build", str(tmp_path / "parts" / "*"), "-o",
                            tmp_path / "out", "--no-progress")
    assert code == 0, err
    origins = [origin_of(record)[0] for record in sample_records(tmp_path / "out")]
    assert origins == [str(tmp_path / "parts" / "TRAIN-0.JSONL")] * half + [
        str(tmp_path / "parts" / "train-1.ndjson")] * (len(good_records) - half)
    code, _, err = cli_main(capsys, "build", str(tmp_path / "none" / "*.jsonl"), "-o",
                            tmp_path / "no", "--no-progress")
    assert code == 2 and f"{tmp_path / 'none' / '*.jsonl'}: matches no file" in err, err
    # a ** glob reaching an earlier build's output (its index.json, skipped.jsonl): those
    # files are no input, said; the same file twice (a glob and its name) is refused
    code, _, err = cli_main(capsys, "build", tmp_path / "parts" / "TRAIN-0.JSONL", "-o",
                            tmp_path / "parts" / "old", "--no-progress")
    assert code == 0, err
    written = sorted(p.name for p in (tmp_path / "parts" / "old").iterdir() if p.name[0] != ".")
    code, _, err = cli_main(capsys, "build", str(tmp_path / "parts" / "**" / "*"), "-o",
                            tmp_path / "again", "--no-progress")
    assert code == 0 and f"{tmp_path / 'parts' / '**' / '*'} leaves out {len(written)} file(s) " \
        f"of mimo datasets (e.g. {tmp_path / 'parts' / 'old' / written[0]}): a build's output " \
        "is no input" in err, err
    assert [origin_of(record)[0] for record in sample_records(tmp_path / "again")] == origins
    code, _, err = cli_main(capsys, "build", str(tmp_path / "parts" / "*"),
                            tmp_path / "parts" / "train-1.ndjson", "-o", tmp_path / "no",
                            "--no-progress")
    assert code == 2 and f"{tmp_path / 'parts' / 'train-1.ndjson'} is given twice: each of its " \
        "records would be read twice; give it once" in err, err
    # a copy under another name (a file fetched twice): the same bytes, refused alike
    copy = tmp_path / "copy-of-train-1.ndjson"
    copy.write_bytes((tmp_path / "parts" / "train-1.ndjson").read_bytes())
    code, _, err = cli_main(capsys, "build", tmp_path / "parts" / "train-1.ndjson", copy,
                            "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and f"{copy} holds the same bytes as {tmp_path / 'parts' / 'train-1.ndjson'}" \
        " (a copy?): each of its records would be read twice" in err, err
    # empty inputs (a partitioned export's empty parts) hold no records to read twice
    (tmp_path / "empty-1.jsonl").write_bytes(b"")
    (tmp_path / "empty-2.jsonl").write_bytes(b"")
    from mimo_data.shards.build import _no_copies
    _no_copies([str(tmp_path / "empty-1.jsonl"), str(tmp_path / "empty-2.jsonl")])
    # a JSON file of records wrapped in an object (a download's {"data": [...]}): the list
    # named, with the command that unwraps it
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": good_records[:2]}, indent=1))
    code, _, err = cli_main(capsys, "build", wrapped, "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and f"{wrapped}: expected a JSON array of records, got a JSON object " \
        f"holding a list under 'data': give that list as the file (e.g. jq '.data' {wrapped} > " \
        "records.json)" in err, err
    # a JSON list of records saved as .jsonl (pretty-printed, with a BOM): read as the list,
    # as --input-format llava too, not as its lines
    listed = tmp_path / "listed.jsonl"
    listed.write_bytes(b"\xef\xbb\xbf\n" + json.dumps(good_records[:3], indent=1).encode())
    for flags in ([], ["--input-format", "llava"]):
        out = tmp_path / f"listed{len(flags)}"
        code, _, err = cli_main(capsys, "build", listed, "-o", out, "--no-progress", *flags)
        assert code == 0, err
        assert read_json(out / "report.json")["records_read"] == 3
        assert [origin_of(record) for record in sample_records(out)] == [
            (str(listed), "index", i) for i in range(3)]
    # LLaMA-Factory's dataset_info.json given for the data: said what it is
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"mllm_demo": {"file_name": "mllm_demo.json",
                                                  "formatting": "sharegpt"}}, indent=2))
    code, _, err = cli_main(capsys, "build", registry, "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and "got a JSON object: LLaMA-Factory's dataset_info.json, which names " \
        "datasets' files; give the files it names" in err, err
    # records saved as UTF-16 (Windows Notepad's "Unicode"): refused, saying how to convert
    wide = tmp_path / "wide.jsonl"
    wide.write_bytes((tmp_path / "parts" / "train-1.ndjson").read_text().encode("utf-16"))
    code, _, err = cli_main(capsys, "build", wide, "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and f"{wide}: UTF-16 text (its byte-order mark ff fe, as Windows " \
        f"Notepad and PowerShell write it): convert it to UTF-8 first (e.g. iconv -f UTF-16 " \
        f"-t UTF-8 {wide} > {tmp_path / 'wide'}.utf8.jsonl)" in err, err
    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress((tmp_path / "parts" / "train-1.ndjson").read_bytes()))
    for flags in ([], ["--input-format", "llava"]):
        code, _, err = cli_main(capsys, "build", packed, "-o", tmp_path / "no", "--no-progress",
                                *flags)
        assert code == 2 and f"{packed}: gzip-compressed: decompress it first (e.g. gzip " \
            f"-dk {packed})" in err, err
    # one named as if it were not (gzip -d refuses a name without .gz): written to another
    disguised = tmp_path / "train.jsonl"
    disguised.write_bytes(packed.read_bytes())
    code, _, err = cli_main(capsys, "build", disguised, "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and f"(e.g. gzip -dc {disguised} > {tmp_path / 'train'}.plain.jsonl)" \
        in err, err
    # another tool's data under gzip's suffix: the file to write keeps the format's extension
    mislabelled = tmp_path / "z.jsonl.gz"
    mislabelled.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(16))       # zstd's magic
    code, _, err = cli_main(capsys, "build", mislabelled, "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and f"(e.g. zstd -dc {mislabelled} > {tmp_path / 'z'}.plain.jsonl)" \
        in err, err
    # a Parquet file given as another format
    pq.write_table(pa.table({"id": ["a"]}), tmp_path / "rows.parquet")
    code, _, err = cli_main(capsys, "build", tmp_path / "rows.parquet", "-o", tmp_path / "no",
                            "--input-format", "llava", "--no-progress")
    assert code == 2 and "rows.parquet: a Parquet file, given --input-format llava: give " \
        "--input-format parquet, or leave it out" in err, err
    # one record saved as a JSON object: wrapped, not its turns taken out (which the advice
    # for a wrapped list gave: a file of turns, each skipped as malformed_record)
    single = tmp_path / "record.json"
    single.write_text(json.dumps(good_records[0], indent=2))
    code, _, err = cli_main(capsys, "build", single, "-o", tmp_path / "no", "--no-progress")
    assert code == 2 and f"{single}: a JSON object, one record (its keys conversations, " \
        "image), where a JSON array of records is read: put it in [ ], or write it as one " \
        f"JSONL line (e.g. jq -c . {single} > records.jsonl)" in err, err
    # records pretty-printed one after another (jq without -c): one refusal saying so, with
    # the command that writes them a line each, not a skip per line nor jq -c '.[]'
    pretty = "\n".join(json.dumps(record, indent=2) for record in good_records[:2])
    for suffix in (".json", ".jsonl", ".bom.jsonl"):          # Notepad's BOM before the '{'
        (tmp_path / f"pretty{suffix}").write_text(("\ufeff" if "bom" in suffix else "") +
                                                  pretty + "\n")
        code, _, err = cli_main(capsys, "build", tmp_path / f"pretty{suffix}", "-o",
                                tmp_path / "no", "--no-progress")
        assert code == 2 and "written over several lines (pretty-printed; jq without -c)" in \
            err and "(e.g. jq -c . FILE > records.jsonl)" in err, err
        assert "jq -c '.[]'" not in err and not (tmp_path / "no").exists(), err
    written = tmp_path / "pretty.jsonl"
    written.write_text("".join(json.dumps(record) + "\n" for record in good_records[:2]))
    code, _, err = cli_main(capsys, "build", written, "-o", tmp_path / "fixed", "--no-progress")
    assert code == 0 and read_json(tmp_path / "fixed" / "report.json")["samples_written"] == 2
    # an empty JSON file holds no record, as an empty JSONL does
    for name in ("empty.json", "empty.jsonl"):
        (tmp_path / name).write_text("\n")
        code, _, err = cli_main(capsys, "build", tmp_path / name, "-o", tmp_path / "no",
                                "--no-progress")
        assert code == 1 and "inputs hold no record" in err, err
    # Common Voice's TSV: named as a file build does not read, with what to write instead
    (tmp_path / "train.tsv").write_text("client_id\tpath\tsentence\nabc\ta.mp3\tHi.\n")
    code, _, err = cli_main(capsys, "build", tmp_path / "train.tsv", "-o", tmp_path / "no",
                            "--no-progress")
    assert code == 2 and "reads no .tsv file" in err, err
    code, _, err = cli_main(capsys, "build", tmp_path / "train.tsv", "-o", tmp_path / "no",
                            "--no-progress", "--input-format", "manifest")   # a skip a line
    assert code == 2 and "reads no .tsv file: write utterances (Common Voice's TSV, " \
        "LibriSpeech's trans.txt) as a NeMo speech manifest" in err and "image captions as " \
        "JSONL records" in err and "--input-format" not in err, err
    # ... but JSONL saved as .txt is told --input-format, which reads it
    (tmp_path / "records.txt").write_text(json.dumps(good_records[0]) + "\n")
    code, _, err = cli_main(capsys, "build", tmp_path / "records.txt", "-o", tmp_path / "no",
                            "--no-progress")
    assert code == 2 and "pass --input-format llava|manifest|parquet" in err, err
    # and a JSON array saved as .txt, given --input-format llava, is read as the array it is
    (tmp_path / "array.txt").write_text(json.dumps(good_records[:2]))
    code, _, err = cli_main(capsys, "build", tmp_path / "array.txt", "-o", tmp_path / "array",
                            "--no-progress", "--input-format", "llava")
    assert code == 0 and read_json(tmp_path / "array" / "report.json")["samples_written"] == 2
    # a COCO annotations file (its images a list of objects) is no record to put in [ ]
    (tmp_path / "captions_train2017.json").write_text(json.dumps({
        "info": {}, "images": [{"id": 1, "file_name": "1.jpg"}],
        "annotations": [{"image_id": 1, "caption": "A cat."}]}, indent=2))
    code, _, err = cli_main(capsys, "build", tmp_path / "captions_train2017.json", "-o",
                            tmp_path / "no", "--no-progress")
    assert code == 2 and "expected a JSON array of records, got a JSON object" in err and \
        "one record" not in err, err


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_content_parts_name_their_media(tmp_path, assets, corpus, corpus_videos, suffix):
    clip = corpus / corpus_videos["zoom_mpeg4_10"].path
    (tmp_path / "pics").mkdir()
    shutil.copy(assets["jpeg"], tmp_path / "photo.jpg")
    shutil.copy(assets["png"], tmp_path / "pics" / "b.png")
    # transformers' chat form: each key it reads, paths relative to the input file or absolute
    user = [{"type": "image", "image": "photo.jpg"},
            {"type": "audio", "path": str(assets["wav"])},
            {"type": "text", "text": "Compare the image, the sound and the clip."},
            {"type": "video", "video": str(clip)},
            {"type": "image", "url": "pics/b.png"}]
    turns = [{"role": "user", "content": user},
             {"role": "assistant", "content": [{"type": "text", "text": "Unrelated."}]}]
    # an image_path kept beside the parts that name the image: metadata, not an unread image
    if suffix == ".jsonl":
        path = write_jsonl(tmp_path / "parts.jsonl", [{"id": "parts", "messages": turns,
                                                       "image_path": "photo.jpg"}])
    else:   # Arrow gives every part every key, None where a part has none
        path = tmp_path / "parts.parquet"
        pq.write_table(pa.table({"id": ["parts"], "messages": [turns],
                                 "image_path": ["photo.jpg"]}), path)
    build_dataset([path], tmp_path / "out")

    report = read_json(tmp_path / "out" / "report.json")
    assert report["records_skipped"] == 0, report["skipped_by_reason"]
    record, members = _samples_by_id(tmp_path / "out")["parts"]
    assert [(m["modality"], m["path"]) for m in record["media"]] == [
        ("image", "photo.jpg"), ("audio", str(assets["wav"])), ("video", str(clip)),
        ("image", "pics/b.png")]
    assert _media(record, members, "image") == [assets["jpeg"].read_bytes(),
                                                assets["png"].read_bytes()]
    assert _media(record, members, "audio") == [assets["wav"].read_bytes()]
    assert _media(record, members, "video") == [clip.read_bytes()]
    # a marker and the text beside it as they are, as Qwen's templates write parts; two texts
    # joined by the part break, which preprocessing makes what the run's template writes
    # between them (tests/test_published_checkpoints.py)
    assert record["messages"][0]["content"] == (
        "<image><audio>Compare the image, the sound and the clip.<video><image>")
    assert normalize_messages([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Look."},
        {"type": "text", "text": "What is it?"}]}, turns[1]])[0]["content"] == \
        f"<image>Look.{TEXT_PART_BREAK}What is it?"
    # a text holding the break itself would read as two parts: refused, string or part
    for content in (f"a{TEXT_PART_BREAK}b", [{"type": "text", "text": f"a{TEXT_PART_BREAK}"}]):
        with pytest.raises(RecordError, match="U\\+E00B"):
            normalize_messages([{"role": "user", "content": content}, turns[1]])
    with pytest.raises(RecordError, match="U\\+E00B"):              # the record's system prompt
        normalize_messages([turns[0], turns[1]], system=f"Be brief.{TEXT_PART_BREAK}")
    with pytest.raises(RecordError, match="U\\+E00B"):              # an answer's reasoning
        normalize_messages([turns[0], {**turns[1], "reasoning_content": TEXT_PART_BREAK}])


def test_indexed_image_parts_take_the_item_they_name(tmp_path, assets):
    """TRL's llava-instruct-mix-vsft rows: bare image parts ``{"type": "image", "index": i,
    "text": null}`` with the images in a list. Each part's marker takes the image its index
    names, not the next in the list; an index naming no item, or an item no part names, is
    refused naming both."""
    jpeg, png = assets["jpeg"].read_bytes(), assets["png"].read_bytes()
    part = pa.struct([("index", pa.int64()), ("text", pa.string()), ("type", pa.string())])
    message = pa.struct([("content", pa.list_(part)), ("role", pa.string())])

    def row(indices):
        content = [{"index": i, "text": None, "type": "image"} if isinstance(i, int) else
                   {"index": None, "text": i, "type": "text"} for i in indices]
        return [{"role": "user", "content": content},
                {"role": "assistant", "content": [{"index": None, "text": "A.", "type": "text"}]}]
    path = tmp_path / "vsft.parquet"
    pq.write_table(pa.table({
        "id": ["swapped", "stray", "unnamed", "holed"],
        "messages": pa.array([row(["This is the cat:", 1, "and the astronaut", 0]),
                              row([0, 2, "Both?"]), row([0, "One?"]), row([2, "Which?"])],
                             pa.list_(message)),
        "images": pa.array([[{"bytes": jpeg, "path": None}, {"bytes": png, "path": None}]] * 3
                           + [[None, {"bytes": None, "path": None}, {"bytes": png, "path": None}]],
                           pa.list_(MEDIA))}), path)
    build_dataset([path], tmp_path / "out")
    record, members = _samples_by_id(tmp_path / "out")["swapped"]
    assert record["messages"][0]["content"].startswith("This is the cat:")
    assert _media(record, members, "image") == [png, jpeg]
    # an index counts the list as written, its null items too
    assert _media(*_samples_by_id(tmp_path / "out")["holed"], "image") == [png]
    # and the single item where the list is null (datasets.to_json's mixed rows)
    single = write_jsonl(tmp_path / "single.jsonl", [{
        "id": "single", "images": [None], "image": str(assets["jpeg"]), "messages": [
            {"role": "user", "content": [{"type": "image", "index": 0},
                                         {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A."}]}])
    build_dataset([single], tmp_path / "single")
    assert _media(*_samples_by_id(tmp_path / "single")["single"], "image") == [jpeg]
    skipped = read_json(tmp_path / "out" / "report.json")["skipped_by_reason"]
    details = [entry["detail"] for entry in skipped["malformed_record"]["first"]]
    assert details == [
        "the image content parts' 'index' values [0, 2] do not each name one of the 2 "
        "'images' items (0 to 1): give every part the index of its item, or none (the list's "
        "order)",
        "images[1] is named by no image content part's 'index' ([0]): every item needs its "
        "part (its marker)"], details


def test_openai_media_parts_name_their_media(tmp_path, assets):
    """OpenAI's vision and audio fine-tuning forms: ``image_url`` parts whose URL is a base64
    ``data:`` URL (line-wrapped too), a ``file://`` URL (percent-encoded) or a path (also as
    the bare string, as vLLM takes it), ``input_audio`` parts with base64 data; each is its
    marker in the text. An http(s) URL is refused as before (mimo downloads nothing), broken
    base64 and a file URL naming a host as malformed, each counted."""
    import base64
    shutil.copy(assets["jpeg"], tmp_path / "photo.jpg")
    shutil.copy(assets["jpeg"], tmp_path / "my photo.jpg")
    jpeg = base64.b64encode(assets["jpeg"].read_bytes()).decode()
    wrapped = "\n".join(jpeg[i:i + 76] for i in range(0, len(jpeg), 76))    # MIME's lines
    wav = base64.b64encode(assets["wav"].read_bytes()).decode()

    def record(key, *parts):
        return {"id": key, "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "A photo."}]}

    def image(url):
        return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}
    path = write_jsonl(tmp_path / "openai.jsonl", [
        record("data", image(f"data:image/jpeg;base64,{jpeg}")),
        record("file", image(f"file://{tmp_path / 'photo.jpg'}")),
        record("path", {"type": "image_url", "image_url": "photo.jpg"}),
        record("audio", {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}),
        record("wrapped", image(f"data:image/jpeg;BASE64,{wrapped}")),
        record("spaced", image(f"file://{tmp_path / 'my%20photo.jpg'}")),
        record("web", image("https://example.com/photo.jpg")),
        record("broken", image("data:image/jpeg;base64,@@@")),
        record("host", image("file://photo.jpg")),
        record("noise", {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}),
        record("axolotl", {"type": "image", "base64": jpeg})])        # transformers' key
    build_dataset([path], tmp_path / "out")
    report = read_json(tmp_path / "out" / "report.json")
    skipped = report["skipped_by_reason"]
    assert {reason: found["count"] for reason, found in skipped.items()} == {
        "missing_media": 1, "malformed_record": 3}
    assert "is a URL, which mimo does not download" in \
        skipped["missing_media"]["first"][0]["detail"]
    details = [found["detail"] for found in skipped["malformed_record"]["first"]]
    assert "not valid base64" in details[0] and "not valid base64" in details[2]
    assert "(a data: URL's, or an input_audio part's)" in details[2]
    assert "names the host 'photo.jpg': a file URL is file:///absolute/path" in details[1]
    samples = _samples_by_id(tmp_path / "out")
    assert sorted(samples) == ["audio", "axolotl", "data", "file", "path", "spaced", "wrapped"]
    for key in ("data", "file", "path", "spaced", "wrapped", "axolotl"):
        found, members = samples[key]
        assert found["messages"][0]["content"] == "<image>What is it?"
        assert _media(found, members, "image") == [assets["jpeg"].read_bytes()]
    assert [m["path"] for m in samples["data"][0]["media"]] == [None]  # not the base64 text
    found, members = samples["audio"]
    assert found["messages"][0]["content"] == "<audio>What is it?"
    assert _media(found, members, "audio") == [assets["wav"].read_bytes()]


def test_a_texts_column_named_as_messages_and_the_cauldrons_exchanges(tmp_path, assets):
    """``--messages-column texts`` makes a ``texts`` column the conversation (not documents);
    the_cauldron's ``texts`` (``{user, assistant, source}`` exchanges, no markers) is read as
    a conversation unasked, its images before the first user text."""
    jpeg, png = assets["jpeg"].read_bytes(), assets["png"].read_bytes()
    exchange = pa.struct([("user", pa.string()), ("assistant", pa.string()),
                          ("source", pa.string())])
    images = pa.array([[{"bytes": jpeg, "path": None}],
                       [{"bytes": jpeg, "path": None}, {"bytes": png, "path": None}]],
                      pa.list_(MEDIA))
    named = tmp_path / "named.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "images": images, "texts": pa.array(
        [[{"role": "user", "content": "<image>\nWhat?"}, {"role": "assistant", "content": "A."}],
         [{"role": "user", "content": "<image><image>\nBoth?"},
          {"role": "assistant", "content": "B."}]],
        pa.list_(MESSAGE))}), named)
    cauldron = tmp_path / "cauldron.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "images": images, "texts": pa.array(
        [[{"user": "What?", "assistant": "A.", "source": "vqav2"}],
         [{"user": "Both?", "assistant": "B.", "source": "x"},
          {"user": "Again?", "assistant": "C.", "source": "x"}]], pa.list_(exchange))}),
        cauldron)
    # the same rows written as JSONL (their images as paths): a conversation, not a document
    lines = write_jsonl(tmp_path / "cauldron.jsonl", [
        {"id": "a", "images": [str(assets["jpeg"])],
         "texts": [{"user": "What?", "assistant": "A.", "source": "vqav2"}]},
        {"id": "b", "images": [str(assets["jpeg"]), str(assets["png"])],
         "texts": [{"user": "Both?", "assistant": "B.", "source": "x"},
                   {"user": "Again?", "assistant": "C.", "source": "x"}]}])
    build_dataset([named], tmp_path / "named", columns={"conversation": "texts"})
    build_dataset([cauldron], tmp_path / "cauldron")
    build_dataset([lines], tmp_path / "lines")
    for out in ("named", "lines", "cauldron"):
        samples = _samples_by_id(tmp_path / out)
        assert samples["a"][0]["messages"][0] == {"role": "user", "content": "<image>\nWhat?"}
        assert _media(*samples["b"], "image") == [jpeg, png]
    assert _samples_by_id(tmp_path / "lines")["b"][0]["messages"] == samples["b"][0]["messages"]
    assert samples["b"][0]["messages"] == [
        {"role": "user", "content": "<image>\n<image>\nBoth?"},
        {"role": "assistant", "content": "B."}, {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "C."}]


def test_a_conversation_with_a_null_texts_field_is_a_conversation(tmp_path, good_records,
                                                                    capsys):
    """A merged export's conversation rows carry the documents' ``texts`` as null (or []):
    read as the conversations they are, not refused as a document beside a conversation."""
    rows = [{**good_records[0], "texts": None}, {**good_records[1], "texts": []}]
    code, _, err = cli_main(capsys, "build", write_jsonl(tmp_path / "merged.jsonl", rows), "-o",
                            tmp_path / "out", "--no-progress")
    assert code == 0 and read_json(tmp_path / "out" / "report.json")["samples_written"] == 2, err


def test_a_table_of_documents_and_conversations_asks_which_it_is(tmp_path, capsys):
    """A merged table with a ``texts`` column (documents) beside ``messages``: refused with
    the flags that say which its rows are, not read as documents of null texts."""
    turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    pq.write_table(pa.table({"id": ["a", "b"], "texts": [None, None],
                             "images": [None, None], "messages": [turns, turns]}),
                   tmp_path / "merged.parquet")
    code, _, err = cli_main(capsys, "build", tmp_path / "merged.parquet", "-o",
                            tmp_path / "no", "--no-progress")
    assert code == 2 and "the columns 'texts' (documents) and 'messages' (conversations): " \
        "name the one its rows are with --texts-column or --messages-column" in err, err
    code, _, err = cli_main(capsys, "build", tmp_path / "merged.parquet", "-o",
                            tmp_path / "out", "--no-progress", "--messages-column", "messages")
    assert code == 0 and read_json(tmp_path / "out" / "report.json")["samples_written"] == 2, err


def test_preference_rows_are_refused_in_json_and_parquet_alike(tmp_path):
    """A KTO row marked undesirable (its answer would train as one to give) is refused from a
    Parquet table as from JSONL, and so is a chosen/rejected pair beside a conversation that
    ends on the user's turn; null preference fields (a merged export's) and a conversation
    that ends on its answer are kept."""
    def turns(*texts):
        return [{"role": role, "content": text}
                for role, text in zip(("user", "assistant"), texts)]
    rows = [(turns("Is it a dog?", "It is a cat."), False, None, None),
            (turns("Is it a dog?"), None, "It is a cat.", "It is a dog."),
            (turns("Is it a dog?", "No, a cat."), None, None, None),
            (turns("Is it a cat?", "Yes."), True, None, None)]
    table = pa.table({"messages": [json.dumps(r[0]) for r in rows],
                      "label": [r[1] for r in rows], "chosen": [r[2] for r in rows],
                      "rejected": [r[3] for r in rows]})
    pq.write_table(table, tmp_path / "kto.parquet")
    write_jsonl(tmp_path / "kto.jsonl", [
        {"messages": r[0], **{k: v for k, v in zip(("label", "chosen", "rejected"), r[1:])}}
        for r in rows])
    for name in ("kto.parquet", "kto.jsonl"):
        build_dataset([tmp_path / name], tmp_path / f"out-{name}")
        report = read_json(tmp_path / f"out-{name}" / "report.json")
        details = [entry["detail"] for entry in
                   report["skipped_by_reason"]["malformed_record"]["first"]]
        assert report["samples_written"] == 2 and len(details) == 2, (name, report)
        assert details[0].startswith("'label' is false: a KTO example of an answer not to "
                                     "give"), details
        assert details[1].startswith("'chosen' and 'rejected' beside a conversation ending on "
                                     "the user's turn: a preference pair"), details
