"""Line charts as PNG, drawn with Pillow: a run's curves.png.

matplotlib drew the same chart in ~1.2 s at the end of every run (0.75 s of import, 0.4 s of drawing)
while the other processes waited; Pillow (torchvision's dependency) imports in 0.01 s and draws this
in a few hundredths. The chart is drawn at twice its size and scaled down, which smooths the lines.
"""
import math

from PIL import Image, ImageDraw, ImageFont

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]  # matplotlib's first four, which users know
SCALE = 2  # drawn at twice the size, then scaled down with a smoothing filter: lines without jagged edges


LARGEST = 1e300  # beyond this a value is left out like a nan: the axis arithmetic would overflow


def plottable(points):
    """The (x, y) points that are finite numbers within +-LARGEST, as floats: metrics.jsonl writes a
    nan or inf loss as null, and a chart must not fail a finished run."""
    kept = []
    for x, y in points:
        try:
            x, y = float(x), float(y)
        except (TypeError, ValueError, OverflowError):
            continue
        if abs(x) <= LARGEST and abs(y) <= LARGEST:  # False for nan too
            kept.append((x, y))
    return kept


def axis_range(values, margin=0.05):
    """[low, high] around the values with a margin on each side (a constant, or values too near zero
    for the margin to show, get a width of their own)."""
    low, high = min(values, default=0.0), max(values, default=1.0)
    pad = (high - low) * margin
    if not (low - pad < low and high < high + pad):
        pad = max(abs(low), abs(high), 1.0) * margin
    return low - pad, high + pad


def nice_ticks(low, high, most=8):
    """Round values inside [low, high], 1, 2 or 5 times a power of ten apart: the closest spacing that
    gives at most `most` of them."""
    power = 10 ** math.floor(math.log10((high - low) / most))
    step = next(m * power for m in (1, 2, 5, 10, 20) if (high - low) / (m * power) < most)
    first = math.ceil(low / step - 1e-9)
    return [i * step for i in range(first, math.floor(high / step + 1e-9) + 1)], step


def tick_labels(ticks, step):
    """The ticks as text, all with as many decimals as the step needs; scientific where that would
    take more than 6 decimals or the values reach a million."""
    largest = max(map(abs, ticks), default=0)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if decimals > 6 or largest >= 1e6:
        digits = max(1, math.floor(math.log10(largest or step)) - math.floor(math.log10(step) + 1e-9))
        return [f"{value:.{digits}e}" for value in ticks]
    return [f"{value:.{decimals}f}" for value in ticks]


def _panel(image, box, panel, xlabel, fonts):
    """One set of axes inside box = (left, top, right, bottom), in drawing pixels."""
    draw = ImageDraw.Draw(image)
    s = SCALE
    lines = [(label, plottable(points), markers) for label, points, markers in panel["lines"]]
    xs = [x for _, points, _ in lines for x, _ in points]
    ys = [y for _, points, _ in lines for _, y in points]
    (x0, x1), (y0, y1) = axis_range(xs), axis_range(ys)
    (xticks, xstep), (yticks, ystep) = nice_ticks(x0, x1), nice_ticks(y0, y1)
    xtexts, ytexts = tick_labels(xticks, xstep), tick_labels(yticks, ystep)
    widest = max(draw.textlength(text, font=fonts["tick"]) for text in ytexts)  # the y label goes left of it
    left, top, right, bottom = box[0] + 34 * s + widest, box[1] + 28 * s, box[2] - 12 * s, box[3] - 44 * s

    def at(x, y):
        return (left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top))

    for x, text in zip(xticks, xtexts):  # grid and tick labels
        px = at(x, y0)[0]
        draw.line([(px, top), (px, bottom)], fill="#e6e6e6", width=s)
        draw.text((px, bottom + 5 * s), text, font=fonts["tick"], anchor="ma", fill="black")
    for y, text in zip(yticks, ytexts):
        py = at(x0, y)[1]
        draw.line([(left, py), (right, py)], fill="#e6e6e6", width=s)
        draw.text((left - 5 * s, py), text, font=fonts["tick"], anchor="rm", fill="black")
    draw.rectangle([left, top, right, bottom], outline="black", width=s)
    for i, (label, points, markers) in enumerate(lines):
        color, xy = COLORS[i % len(COLORS)], [at(x, y) for x, y in points]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=2 * s, joint="curve")
        if markers or len(xy) == 1:
            for px, py in xy:
                draw.ellipse([px - 4 * s, py - 4 * s, px + 4 * s, py + 4 * s], fill=color)
    draw.text(((left + right) / 2, top - 8 * s), panel["title"], font=fonts["title"], anchor="md", fill="black")
    draw.text(((left + right) / 2, bottom + 24 * s), xlabel, font=fonts["label"], anchor="ma", fill="black")
    ylabel = Image.new("RGBA", (int(bottom - top), 18 * s), (255, 255, 255, 0))
    ImageDraw.Draw(ylabel).text((ylabel.width / 2, ylabel.height / 2), panel["ylabel"], font=fonts["label"],
                                anchor="mm", fill="black")
    ylabel = ylabel.rotate(90, expand=True)
    image.paste(ylabel, (int(box[0] + 4 * s), int(top)), ylabel)
    if len(lines) > 1:  # legend, top right
        row = 16 * s
        width = 20 * s + max(draw.textlength(label, font=fonts["tick"]) for label, _, _ in lines)
        lx, ly = right - width - 14 * s, top + 8 * s
        draw.rectangle([lx - 6 * s, ly - 4 * s, right - 8 * s, ly + row * len(lines)], fill="white", outline="#cccccc")
        for i, (label, _, markers) in enumerate(lines):
            cy, color = ly + row * i + row / 2, COLORS[i % len(COLORS)]
            draw.line([(lx, cy), (lx + 14 * s, cy)], fill=color, width=2 * s)
            if markers:
                draw.ellipse([lx + 7 * s - 3 * s, cy - 3 * s, lx + 7 * s + 3 * s, cy + 3 * s], fill=color)
            draw.text((lx + 20 * s, cy), label, font=fonts["tick"], anchor="lm", fill="black")


def draw_chart(path, panels, xlabel, size=(1000, 400)):
    """Write a PNG of panels side by side. Each panel is {"title", "ylabel", "lines": [(label,
    [(x, y), ...], markers)]}; points that are not finite are left out, a panel with no points keeps
    its axes. A legend appears where a panel has more than one line."""
    width, height = size
    image = Image.new("RGB", (width * SCALE, height * SCALE), "white")
    fonts = {name: ImageFont.load_default(size=points * SCALE)  # Pillow's own font: no system fonts needed
             for name, points in (("tick", 11), ("label", 12), ("title", 14))}
    panel_width = width * SCALE / len(panels)
    for i, panel in enumerate(panels):
        _panel(image, (i * panel_width, 0, (i + 1) * panel_width, height * SCALE), panel, xlabel, fonts)
    image.resize(size, Image.LANCZOS).save(path, format="PNG", optimize=False)
    return path
