"""`persrag data convert`: a user's own interaction log to a LaMP folder that `pipeline --data_dir`
trains on.

    persrag data convert reviews.csv --task LaMP-3 --user reviewer_id --date time --text review
        --label stars \\ --item product_id --out data/my_reviews
    python train.py pipeline --preset quick --task LaMP-3 --data_dir data/my_reviews
    persrag data convert news.json.gz --task labels --user authors --user_sep , --date date \\
        --text headline,short_description --label category --out data/my_news
    python train.py pipeline --preset quick --data_dir data/my_news

The split and the history rules it relies on: persrag_lightning/data/convert.py and
docs/data/your-own-data.md.
"""

from __future__ import annotations

import argparse

from persrag_lightning.data.convert import LAYOUTS, ConvertOptions, convert_log
from persrag_lightning.data.log_files import FORMATS, LogFormatError
from persrag_lightning.data.tasks import LABEL_TASK
from persrag_lightning.utils import one_flag_style

__all__ = ["data_command"]

FIELDS = {"description": "LaMP-2's text", "tag": "LaMP-2's label", "score": "LaMP-3's label",
          "title": "LaMP-4's and LaMP-5's label", "abstract": "LaMP-5's text"}


class _Parser(argparse.ArgumentParser):
    # argparse prints usage + error on two lines; the house rule is one
    def error(self, message: str) -> None:
        raise LogFormatError(f"{self.prog}: {message}")


def parser() -> argparse.ArgumentParser:
    d = ConvertOptions(task="LaMP-3", user="", date="", text="", label="")
    p = _Parser(prog="persrag data", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    c = sub.add_parser("convert", help="a log (CSV, JSON Lines, JSON, Parquet) to a LaMP folder, split by time",
                       description=f"Formats by extension: {', '.join(sorted(FORMATS))}; JSON (a list or JSON "
                                   "Lines) by content whatever the name; gzipped files read directly.")
    c.add_argument("log", help="the log file")
    c.add_argument("--task", required=True, choices=list(LAYOUTS),
                   help=f"the LaMP task the folder is for, or {LABEL_TASK}: a classification task with the log's own "
                        "labels (those of the train split)")
    c.add_argument(
        "--out", required=True, help="the LaMP folder to write (appears whole or not at all)"
    )
    c.add_argument("--overwrite", action="store_true", help="replace --out if it holds files")
    c.add_argument("--strict", action="store_true",
                   help="refuse the log at its first bad row (default: skip bad rows, counted by reason)")
    _add_log_columns(c)
    _add_split_options(c, d)
    return one_flag_style(p)


def _add_log_columns(convert: argparse.ArgumentParser) -> None:
    """The convert options that name the log's columns: who, when, the text, the label, the item."""
    columns = convert.add_argument_group("columns of the log")
    columns.add_argument("--user", required=True, help="who produced the item")
    columns.add_argument("--user_sep", default=None,
                         help="the separator of several users in one cell (co-authors 'A, B': --user_sep ,); each "
                              "named user gets the item")
    columns.add_argument("--date", required=True, help="when: ISO 8601 date or date-time (naive = UTC), or "
                                                       "Unix seconds")
    columns.add_argument("--text", help="the item's text (several columns: a,b, joined as sentences in that order): "
                                        "LaMP-2's description, LaMP-3's review, LaMP-4's article, LaMP-5's abstract")
    columns.add_argument("--label", help="what the question asks: LaMP-2's tag, LaMP-3's score (1–5), LaMP-4's and "
                                         f"LaMP-5's title, {LABEL_TASK}: the log's own label")
    for name, what in FIELDS.items():
        columns.add_argument(
            f"--{name}", help=f"the task's own name for --text or --label ({what})"
        )
    columns.add_argument("--item", default=None, help="an item id (a product, a movie); a user may hold it once (a "
                                                      "later row giving it again is skipped)")


def _add_split_options(convert: argparse.ArgumentParser, d: ConvertOptions) -> None:
    """The convert options of the time-based split (their defaults are ConvertOptions')."""
    split = convert.add_argument_group("the time-based split")
    split.add_argument("--min_items", type=int, default=d.min_items,
                       help="drop users with fewer items (default %(default)s, the k-core convention)")
    split.add_argument("--train_per_user", type=int, default=d.train_per_user,
                       help="train questions per user, before the dev and test items (default %(default)s)")
    split.add_argument(
        "--max_test_users", type=int, default=None, help="a seeded random subset of test users"
    )
    split.add_argument(
        "--max_dev_users", type=int, default=None, help="a seeded random subset of dev users"
    )
    split.add_argument(
        "--seed", type=int, default=d.seed, help="the subsets' seed (default %(default)s)"
    )
    split.add_argument("--dedupe", action="store_true",
                       help="keep one of a user's items with the same text (the oldest); they are counted either way")
    split.add_argument("--template", default=None,
                       help="the question's input, with {text} where the item's text goes (default: LaMP's prompt)")


def _field_columns(opts: argparse.Namespace) -> tuple[str, str]:
    """The text and label columns, named generically (--text, --label) or by the task's LaMP fields
    (LaMP-2's --description and --tag, LaMP-3's --score, LaMP-4's and LaMP-5's --title, LaMP-5's
    --abstract).

    Args:
        opts: the parsed `persrag data convert` arguments; the generic (--text, --label) or the
            task's own field flags name the columns.
    """
    layout = LAYOUTS[opts.task]
    for name in FIELDS:
        if getattr(opts, name) is not None and name not in (layout.text_field, layout.label_field):
            raise LogFormatError(
                f"--{name}: not a field of {opts.task}; name its columns with --text and --label "
                f"(or --{layout.text_field} and --{layout.label_field})"
            )
    out = []
    for generic, field in (("text", layout.text_field), ("label", layout.label_field)):
        given = {f"--{generic}": getattr(opts, generic)}
        if field != generic:
            given[f"--{field}"] = getattr(opts, field)
        named = {k: v for k, v in given.items() if v is not None}
        if len(named) != 1:
            raise LogFormatError(
                f"{' or '.join(given)}: {'give one of them' if len(named) > 1 else 'required'} "
                f"(the log's column of {opts.task}'s {field})"
            )
        out.append(next(iter(named.values())))
    return out[0], out[1]


def data_command(args: list[str]) -> None:
    """`persrag data convert LOG --task T --user C --date C --text C[,C] --label C [--item C] --out
    DIR`.

    Args:
        args: the command line after `persrag data`.
    """
    opts = parser().parse_args(args)
    text, label = _field_columns(opts)
    options = ConvertOptions(task=opts.task, user=opts.user, date=opts.date, text=text, label=label,
                             item=opts.item, min_items=opts.min_items, train_per_user=opts.train_per_user,
                             max_test_users=opts.max_test_users, max_dev_users=opts.max_dev_users, seed=opts.seed,
                             template=opts.template, strict=opts.strict, user_sep=opts.user_sep, dedupe=opts.dedupe)
    conversion = convert_log(opts.log, opts.out, options, overwrite=opts.overwrite)
    print(conversion.summary())
    print(
        f"wrote {opts.out} (train, dev and test questions and golds, convert.json); train on it with:\n"
        f"  python train.py pipeline --preset quick --task {conversion.task} --data_dir {opts.out}"
    )
