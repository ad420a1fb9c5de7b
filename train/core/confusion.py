"""A classifier's confusion matrix: the metrics it gives (accuracy, macro-F1) and its PNG.

Rows are the true classes, columns the predicted ones; each cell shows its count, shaded by the
share of its row (so a rare class's errors show as plainly as a common one's).
"""

from PIL import Image, ImageDraw, ImageFont


def confusion_metrics(confusion):
    """Accuracy and macro-F1 of a square matrix of counts (a list of lists). Macro-F1 averages F1 over
    the classes that occur as a label or a prediction, as scikit-learn's f1_score(average="macro")."""
    n = len(confusion)
    total = sum(map(sum, confusion))
    correct = sum(confusion[i][i] for i in range(n))
    scores = []
    for c in range(n):
        true, predicted = sum(confusion[c]), sum(row[c] for row in confusion)
        if true or predicted:
            scores.append(2 * confusion[c][c] / (true + predicted))
    return {"accuracy": correct / max(total, 1), "f1": sum(scores) / max(len(scores), 1)}


MAX_CLASSES = 60  # beyond this a chart of counts is no longer readable: all_results.json keeps the matrix


def draw_confusion(path, confusion, names, title="confusion matrix (rows: true, columns: predicted)"):
    """Write the matrix as a PNG with the class names on both axes; returns path (None, drawing
    nothing, for more than MAX_CLASSES classes)."""
    if len(names) > MAX_CLASSES:
        return None
    n, cell = len(names), 44 if len(names) <= 12 else 28
    font = ImageFont.load_default(size=12 if n <= 12 else 9)  # Pillow's own font: no system fonts needed
    label_width = 12 + max(int(font.getlength(name)) for name in names)
    top = 40 + label_width  # the column names stand upright above the grid
    size = (label_width + n * cell + 20, top + n * cell + 20)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black", font=font)
    for j, name in enumerate(names):  # column names, rotated
        text = Image.new("RGBA", (label_width, cell), (255, 255, 255, 0))
        ImageDraw.Draw(text).text((4, cell / 2), name, fill="black", font=font, anchor="lm")
        text = text.rotate(90, expand=True)
        image.paste(text, (label_width + j * cell, top - label_width), text)
    for i, name in enumerate(names):
        draw.text((label_width - 6, top + i * cell + cell / 2), name, fill="black", font=font, anchor="rm")
        row_total = max(sum(confusion[i]), 1)
        for j in range(n):
            share = confusion[i][j] / row_total
            shade = int(255 - 200 * share)
            box = (label_width + j * cell, top + i * cell, label_width + (j + 1) * cell, top + (i + 1) * cell)
            draw.rectangle(box, fill=(shade, shade, 255) if i != j else (shade, 255, shade), outline="#bbbbbb")
            draw.text(
                ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2),
                str(confusion[i][j]),
                fill="white" if share > 0.6 else "black",
                font=font,
                anchor="mm",
            )
    image.save(path, format="PNG")
    return path
