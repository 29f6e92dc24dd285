"""The HTML report of ``mimo-inspect report --html``: one self-contained file.

Plots are matplotlib PNGs embedded as ``data:`` URIs; the gallery shows the flagged samples (and
a few kept examples) with image thumbnails and log-mel spectrograms (the encoder's own features)
next to their tokens coloured by class. Only the gallery decodes media, from the shards.
The page sets ``data-images-total`` / ``data-images-loaded`` on ``<body>`` once loaded, so a
headless browser can check that every image rendered.
"""

from __future__ import annotations

import base64
import html
import io

from mimo_data.files import write_atomic
from mimo_data.modalities import MODALITIES
from mimo_data.inspect.report import cut_line, eos_line, inspect_position, kinds_line
from mimo_data.inspect.sample import sample_problems, token_view
from mimo_data.inspect.stats import (IndexTable, SampleInspector, SampleStats,
                                     expected_item_tokens)
from mimo_data.shards.index import DatasetError
from mimo_data.shards.reader import ShardReader

COLORS = {"trained": "#1a7f37", "prompt": "#57606a",
          **{name: m.html_color for name, m in MODALITIES.items()}, "padding": "#afb8c1"}

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1f2328; max-width: 1200px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: left; }
tr:nth-child(even) { background: #f6f8fa; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
.plots img { margin: 4px; border: 1px solid #d0d7de; }
.sample { border: 1px solid #d0d7de; border-radius: 6px; padding: 10px; margin: 12px 0; }
.media { display: flex; flex-wrap: wrap; gap: 10px; margin: 6px 0; }
.media figure { margin: 0; } figcaption { font-size: 0.8em; color: #57606a; }
.tokens { font-family: ui-monospace, monospace; font-size: 0.85em; white-space: pre-wrap;
          background: #f6f8fa; padding: 8px; max-height: 24em; overflow: auto; }
.problem { color: #cf222e; } .note { color: #57606a; font-style: italic; }
.t-trained { color: #1a7f37; background: #dafbe1; }
.t-prompt { color: #57606a; }
.t-padding { color: #6e7781; background: #eaeef2; border-radius: 3px; padding: 0 2px; }
""" + "".join(f".t-{name} {{ color: #fff; background: {m.html_color}; border-radius: 3px; "
            "padding: 0 2px; }\n" for name, m in MODALITIES.items())

_SCRIPT = """
window.addEventListener('load', function () {
  var images = Array.prototype.slice.call(document.images);
  var loaded = images.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  document.body.setAttribute('data-images-total', String(images.length));
  document.body.setAttribute('data-images-loaded', String(loaded.length));
});
"""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("mimo-inspect report --html needs matplotlib: pip install matplotlib") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _figure_uri(plt, figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(figure)
    return _png_uri(buffer.getvalue())


def _bar_plot(plt, histogram: list[dict], title: str, xlabel: str, color: str,
              vline: float | None = None) -> str:
    figure, axis = plt.subplots(figsize=(5, 3))
    if histogram:
        lows = [b["lo"] for b in histogram]
        widths = [b["hi"] - b["lo"] for b in histogram]
        axis.bar(lows, [b["count"] for b in histogram], width=widths, align="edge",
                 color=color, edgecolor="white")
    if vline is not None:
        axis.axvline(vline, color="#cf222e", linestyle="--", linewidth=1)
    axis.set_title(title)
    axis.set_xlabel(xlabel)
    axis.set_ylabel("samples")
    return _figure_uri(plt, figure)


def plots(report: dict) -> list[tuple[str, str]]:
    """(title, PNG data URI) of each plot of the report."""
    plt = _pyplot()
    found = [
        ("Trained-token fraction per sample", _bar_plot(
            plt, report["trained_fraction"]["histogram"], "Trained-token fraction per sample",
            "trained tokens / sample length", COLORS["trained"])),
        ("Sequence length", _bar_plot(
            plt, report["sequence_length"]["histogram"], "Sequence length (kept samples)",
            "tokens (red: seq_length)", COLORS["prompt"], vline=report["seq_length"])),
    ]
    for modality, data in report["modalities"].items():
        if data["items"]:
            title = f"{modality} tokens per item"
            found.append((title, _bar_plot(plt, data["tokens_per_item"]["histogram"], title,
                                           "placeholder tokens", COLORS.get(modality, "#333"))))
    reasons = {r: d["count"] for r, d in report["drop_reasons"].items()}
    if reasons:
        figure, axis = plt.subplots(figsize=(5, 3))
        axis.barh(list(reasons), list(reasons.values()), color="#cf222e")
        axis.set_title("Dropped samples by reason")
        axis.set_xlabel("samples")
        found.append(("Dropped samples by reason", _figure_uri(plt, figure)))
    return found


def _media_html(reader, stats: SampleStats, record: dict, inspector,
                damaged: list[str]) -> str:
    parts = []
    for item in record.get("media") or []:
        modality = item.get("modality")
        tokens = expected_item_tokens(item, inspector.config)
        kind = MODALITIES.get(modality)
        caption = f"{item.get('member')}: {kind.describe(item) if kind else modality}"
        caption += f", {tokens if tokens is not None else '?'} tokens"
        try:
            if kind is None or modality not in inspector.config.modalities:
                raise ValueError(f"modality {modality!r} is not configured")
            png, problem = kind.preview_png(reader.read_member(stats.position, item["member"]),
                                            item, inspector.config.modalities[modality])
            uri = _png_uri(png)
        except Exception as exc:   # a bad item is what the gallery is for: say so, go on
            if isinstance(exc, DatasetError):     # bytes changed since the build: the dataset's
                damaged.append(str(exc))
            member = html.escape(str(item.get("member")))
            parts.append(f'<figure><div class="problem">cannot show {member}: '
                         f"{html.escape(str(exc))[:300]}</div></figure>")
            continue
        problem = f'<div class="problem">{html.escape(problem)}</div>' if problem else ""
        parts.append(f'<figure><img src="{uri}" alt="{html.escape(caption)}">'
                     f"<figcaption>{html.escape(caption)}</figcaption>{problem}</figure>")
    return f'<div class="media">{"".join(parts)}</div>' if parts else ""


def _tokens_html(inspector, stats: SampleStats, record: dict, sample) -> str:
    view = token_view(inspector, record, stats, sample)
    spans = "".join(f'<span class="t-{run.cls}" title="{run.cls}, {run.count} tokens">'
                    f"{html.escape(run.text)}</span>" for run in view.runs)
    note = f'<div class="note">{html.escape(view.note)}</div>' if view.note else ""
    return f'{note}<div class="tokens">{spans}</div>'


def _sample_html(plt, reader, inspector, entry, damaged: list[str]) -> str:
    stats, record, sample, labels = entry
    title = f"{html.escape(stats.key)} (position {stats.position})"
    tags = " ".join(f'<span class="fail">{html.escape(label)}</span>' for label in labels)
    if record is None:
        return (f'<div class="sample"><b>{title}</b> {tags}<div class="problem">'
                f"{html.escape(stats.detail)}</div></div>")
    source = " ".join(f"{k} {v}" for k, v in (record.get("source") or {}).items())
    if stats.dropped:
        status = f"dropped ({html.escape(stats.dropped)})"
    else:
        status = (f"{stats.length} tokens, {stats.trained} trained, "
                  f"{stats.removed_turns} turn(s) removed")
    problems = "".join(f'<div class="problem">{html.escape(p)}</div>'
                       for p in sample_problems(stats))
    return (f'<div class="sample" id="sample-{html.escape(stats.key)}"><b>{title}</b> {tags}'
            f"<div>{html.escape(source)} · {status}</div>{problems}"
            f"{_media_html(reader, stats, record, inspector, damaged)}"
            f"{_tokens_html(inspector, stats, record, sample)}</div>")


class Gallery:
    """Picks the samples to show while the report runs: the first ``per_check`` of each kind
    of problem, and kept examples with distinct sets of modalities."""

    def __init__(self, per_check: int = 6, examples: int = 3):
        self.per_check = per_check
        self.examples = examples
        self.counts: dict[str, int] = {}
        self.flagged: dict[int, list[str]] = {}      # position -> labels
        self.example_positions: list[int] = []
        self._example_kinds: set = set()

    def __call__(self, stats: SampleStats) -> None:
        labels = self.labels(stats)
        wanted = [label for label in labels if self.counts.get(label, 0) < self.per_check]
        if wanted:
            for label in wanted:
                self.counts[label] = self.counts.get(label, 0) + 1
            self.flagged[stats.position] = labels
        elif not labels and stats.media and len(self.example_positions) < self.examples:
            kinds = frozenset(stats.media)
            if kinds not in self._example_kinds:
                self._example_kinds.add(kinds)
                self.example_positions.append(stats.position)

    @staticmethod
    def labels(stats: SampleStats) -> list[str]:
        labels = []
        if stats.dropped:
            labels.append("zero_trained" if stats.dropped == "no_trained_tokens"
                          else f"dropped: {stats.dropped}")
        if stats.template_failure:
            labels.append("template_failure")
        if stats.removed_turns:
            labels.append("truncated")
        if stats.empty_answers:
            labels.append("empty_answer_turns")
        if stats.reasoning_dropped:
            labels.append("reasoning_dropped")
        if stats.unclosed_think:
            labels.append("unclosed_think")
        if stats.trailing_turns:
            labels.append("trailing_turns")
        if stats.marker_mismatch:
            labels.append("marker_mismatch")
        if stats.placeholder_mismatch:
            labels.append("placeholder_mismatch")
        if stats.index_problems:
            labels.append("index_mismatch")
        if stats.coverage_failure:
            labels.append("loss_mask_coverage")
        return labels


def write_html(report: dict, gallery: Gallery, directory: str, inspector: SampleInspector,
               path: str, config_path: str = "", cache_dir: str | None = None) -> list[str]:
    """Write the self-contained HTML report; what its gallery found damaged in the dataset
    (a member whose bytes changed since the build), one message each."""
    plt = _pyplot()
    reader = ShardReader(directory, cache_dir)
    index = IndexTable(directory)

    def shown(position: int, labels: list[str]) -> str:
        stats, record, sample = inspect_position(reader, inspector, index, position)
        return _sample_html(plt, reader, inspector, (stats, record, sample, labels), damaged)

    damaged: list[str] = []

    try:
        flagged = [shown(p, labels) for p, labels in sorted(gallery.flagged.items())]
        examples = [shown(p, []) for p in gallery.example_positions]
    finally:
        reader.close()
    rows = "".join(
        f"<tr><td class=\"{'pass' if c['passed'] else 'fail'}\">"
        f"{'PASS' if c['passed'] else 'FAIL'}</td><td>{html.escape(c['name'])}</td>"
        f"<td>{html.escape(c['message'])}</td></tr>" for c in report["checks"])
    tokens = report["tokens"]
    summary = (f"{report['samples']} of {report['total_samples']} samples inspected, "
               f"{report['kept']} kept, {report['dropped']} dropped; {tokens['real']} real "
               f"tokens, {tokens['trained']} trained ({tokens['trained_fraction']:.1%}); "
               f"seq_length {report['seq_length']}, {report['length_policy']}; record kinds: "
               f"{kinds_line(report['kinds'])}; end of turn: {eos_line(report['append_eos'])}")
    cut = report["modalities"].get("audio", {}).get("cut")
    if cut is not None:
        summary += f"; audio: {cut_line(cut)}"
    plot_html = "".join(f'<img src="{uri}" alt="{html.escape(title)}" title="{html.escape(title)}">'
                        for title, uri in plots(report))
    legend = " ".join(f'<span class="t-{cls}">{cls}</span>'
                      for cls in ("trained", "prompt", *inspector.config.modalities, "padding"))
    verdict = ('<span class="pass">all checks pass</span>' if report["passed"]
               else '<span class="fail">some checks fail</span>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>mimo-inspect report: {html.escape(directory)}</title>
<style>{_CSS}</style></head>
<body>
<h1>mimo-inspect report: {verdict}</h1>
<p>{html.escape(directory)} · config {html.escape(config_path)}<br>{html.escape(summary)}</p>
<h2>Checks</h2><table>{rows}</table>
<h2>Distributions</h2><div class="plots">{plot_html}</div>
<h2>Flagged samples ({len(flagged)} shown, up to {gallery.per_check} per kind)</h2>
<p>Tokens: {legend}</p>
{''.join(flagged) or '<p>No flagged samples.</p>'}
<h2>Examples of kept samples</h2>
{''.join(examples) or '<p>None.</p>'}
<script>{_SCRIPT}</script>
</body></html>
"""
    write_atomic(path, page.encode("utf-8"))
    return damaged

