"""The text a healing trains and measures on: read from a GLUE task, a local file or the Hub, then tokenized; or
sampled from a causal-LM teacher."""

import collections
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

from ..devices import compute_device
from ..probes.sampling import continue_texts, start_token, uniform_draws
from ..sharding import from_main_process, loads_weights, process_share, sharded
from ..tasks import GLUE_TASKS, load_task
from .options import HealError, HealOptions


SAMPLED_HELD_OUT = "sst2-sample"  # the held-out text of a healing on text sampled from the teacher


@dataclass
class HealTexts:
    """The tokenized training rows with the collator that batches them, and the padded held-out batches."""

    train: Dataset | torch.utils.data.IterableDataset
    collator: Callable[[list[dict]], dict]
    held_out: list[dict]
    held_out_rows: int
    columns: list[str]
    development: list[dict] | None = None  # data="teacher", with stop_patience or a gradual swap_schedule


def read_texts(options: HealOptions) -> tuple[Dataset, Dataset, list[str]]:
    """The options' text as `load_texts` reads it (with `data="teacher"`, the held-out SST-2 sample), before any
    model loads; refused in one line if the processes of a launch cannot share `batch_size` equally."""
    process_share(options.batch_size, HealError)
    data = SAMPLED_HELD_OUT if options.data == "teacher" else options.data
    return load_texts(data, text_column=options.text_column, data_dir=options.data_dir, held_out=options.eval_size)


def heal_texts(read: tuple, *, options: HealOptions, tokenizer, teacher: torch.nn.Module) -> HealTexts:
    """The text `read_texts` read, tokenized; at most `eval_size` held-out rows, in batches of a process's share of
    `batch_size`. With the `mlm` objective, training batches have 15% of their tokens masked. With `data="teacher"`,
    the training text is sampled from the teacher and the held-out text is the SST-2 sample's."""
    size = process_share(options.batch_size)  # every process measures every held-out batch
    train, held_out, columns = read
    sampled = options.data == "teacher"
    if sampled:
        train = teacher_samples(teacher, tokenizer, options)
    else:
        train = _tokenize(train, columns, tokenizer, options.max_length, options.data)
    held_out = held_out.select(range(min(options.eval_size, len(held_out))))
    held_out = _tokenize(held_out, columns, tokenizer, options.max_length, options.data)
    pad = DataCollatorWithPadding(tokenizer)
    batches = [
        dict(pad([held_out[i] for i in range(start, min(start + size, len(held_out)))]))
        for start in range(0, len(held_out), size)
    ]
    if isinstance(train, TeacherSamples):  # a causal LM's texts, with the teacher's states where they came with them
        collator = WithTeacherStates(pad)
    elif options.objective == "mlm":
        collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    else:
        collator = pad
    measured = options.stop_patience or options.swap_schedule != "direct"  # the stop; a norm-free student's stages
    development = development_batches(teacher, tokenizer, options) if sampled and measured else None
    return HealTexts(
        train=train,
        collator=collator,
        held_out=batches,
        held_out_rows=len(held_out),
        columns=columns,
        development=development,
    )


def load_texts(
    data: str, *, held_out: int, text_column: str | None = None, data_dir: str | None = None
) -> tuple[Dataset, Dataset, list[str]]:
    """Training and held-out text from `data`: `sst2-sample`, a GLUE task name, a local .txt (one text a line), CSV or
    JSON-lines file, or a datasets hub id; returns (train, held_out, text columns). Without a validation split, the
    held-out texts are `held_out` of the training split's (at most a tenth of it)."""
    if data == "sst2-sample" or data in GLUE_TASKS:
        task = load_task(data, data_dir=data_dir)
        return task.data["train"], task.data["validation"], list(task.text_columns)
    splits = _read_splits(data)
    train = splits["train"]
    column = text_column or ("text" if "text" in train.column_names else None)
    if column is None or column not in train.column_names:
        raise HealError(
            f"--data {data}: no text column {column or 'text'!r} (name one with --text-column); columns: "
            f"{train.column_names}"
        )
    if len(train) == 0:
        raise HealError(f"data file {data} is empty")
    if "validation" in splits:
        return train, splits["validation"], [column]
    parts = train.train_test_split(test_size=min(held_out, max(1, len(train) // 10)), seed=0)
    return parts["train"], parts["test"], [column]


def _read_splits(data: str) -> dict[str, Dataset]:
    """The splits of a local .txt (one text a line), CSV or JSON-lines file, or of a datasets hub id."""
    path = Path(data)
    if path.is_file() and path.stat().st_size == 0:
        raise HealError(f"data file {data} is empty")
    try:
        if path.suffix == ".txt":
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if not lines:
                raise HealError(f"data file {data} holds no text")
            return {"train": Dataset.from_dict({"text": lines})}
        if path.is_file():
            return load_dataset("csv" if path.suffix == ".csv" else "json", data_files=str(path))
        if path.exists():
            raise HealError(f"--data {data}: a folder; give a .txt, .csv or .jsonl file, a GLUE task or a hub id")
        return load_dataset(data)
    except HealError:
        raise
    except Exception as error:
        raise HealError(f"--data {data}: cannot be read ({str(error).splitlines()[0]})") from None


def _tokenize(rows: Dataset, columns: list[str], tokenizer, max_length: int, name: str) -> Dataset:
    """Token ids of the texts, dropping rows that hold no token besides special ones."""
    encoded = rows.map(
        lambda batch: tokenizer(
            *(batch[c] for c in columns), truncation=True, max_length=max_length, return_special_tokens_mask=True
        ),
        batched=True,
        remove_columns=rows.column_names,
    )
    encoded = encoded.filter(lambda row: sum(row["special_tokens_mask"]) < len(row["input_ids"]))
    if len(encoded) == 0:
        raise HealError(f"{name}: the text holds no tokens")
    return encoded.remove_columns("special_tokens_mask")


CPU_SAMPLING_WORK = 256 * 134_515_008  # texts x teacher parameters a decoding step: SmolLM2-135M's 256 texts


def sampled_together(teacher: torch.nn.Module, options: HealOptions | None = None) -> int:
    """How many texts a seeded group of `teacher`'s samples holds, whatever the device and the process count: at most
    as many as give a CPU's decoding step the work of SmolLM2-135M's 256 texts (texts x parameters; its groups of 64
    sample a text 1.1 to 1.4 times slower), in powers of two from 64 to 1024, since a smaller model's steps wait on
    Python more than on arithmetic; where `options` say how many texts the healing reads (`_texts_read`), as few as
    cover them in that many groups, so that fewer than one text a group goes unread (measured:
    docs/experiments/healing.md). An accelerator samples several groups at once (`groups_at_once`)."""
    parameters = sum(parameter.numel() for parameter in teacher.parameters())
    most = min(1024, max(64, 2 ** int(math.log2(CPU_SAMPLING_WORK / parameters))))
    texts = None if options is None else _texts_read(options)
    if texts is None:
        return most
    reads = options.sample_reads
    groups = next(count for count in itertools.count(1) if most * _group_readings(count, reads) >= texts)
    return math.ceil(texts / _group_readings(groups, reads))


ACCELERATOR_TEXTS = 1024  # texts an accelerator samples at once, whose decoding steps wait on Python


def groups_at_once(teacher: torch.nn.Module, together: int) -> int:
    """How many groups of `together` texts `teacher` samples in one generation: one on a CPU, else as many as fit in
    ACCELERATOR_TEXTS; the texts are the same either way, each drawn from its own row of its group's draws."""
    return 1 if compute_device(teacher).type == "cpu" else max(1, ACCELERATOR_TEXTS // together)


def _texts_read(options: HealOptions) -> int | None:
    """The texts a healing reads from the teacher's samples: `sample_count`, else its steps' batches and the one the
    data loader reads ahead to see whether the stream has ended (None before the steps are set)."""
    if options.sample_count is not None:
        return options.sample_count
    return None if options.max_steps is None else (options.max_steps + 1) * options.batch_size


def _group_readings(groups: int, sample_reads: int) -> int:
    """How many group readings the stream has made once it has sampled `groups`: each group's first, and one more of
    each of the `sample_reads` - 1 groups before it (`TeacherSamples`)."""
    return sum(min(group, sample_reads) for group in range(1, groups + 1))


TEACHER_STATES = "teacher_hidden_states"  # a sampled text's key: the teacher's states at every boundary
DEVELOPMENT_GROUP = 2**31 - 1  # the seed of the development texts' group, which no training group takes
DEVELOPMENT_BATCH = 16  # development texts a forward measures


class TeacherSamples(torch.utils.data.IterableDataset):
    """An endless stream of texts of `length` tokens sampled from a causal-LM teacher at `temperature`,
    `sampled_together` a group, each group's draws seeded by its index (`uniform_draws`), so that a run can be
    reproduced whatever its device and process count. Each text is read `sample_reads` times: a group's first reading,
    then the earlier groups' next readings, each in a seeded order. Every second text is sampled without the token
    `start`, from a first token drawn after it, so that the student learns both ways a text reaches the model: after
    BOS (a chat template) and without it (a tokenizer that adds none). With `states`, each text comes with the states
    its sampling computed (`TEACHER_STATES`: boundaries x length x hidden), which are the teacher's states on it, so
    that training need not run the teacher again. The groups that hold the texts the layers' fit reads (the first
    `reconstruct_sequences`, with `reconstruct_steps`) are kept until the stream has read them for the last time, so
    that training reads them again without sampling them again."""

    def __init__(self, teacher: torch.nn.Module, start: int, pad: int | None, options: HealOptions, states: bool):
        self.teacher, self.start, self.pad, self.options, self.states = teacher, start, pad, options, states
        self.together = sampled_together(teacher, options)
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def planned(self, options: HealOptions) -> "TeacherSamples":
        """This stream for `options` whose steps are set, its groups sized to the texts those steps read."""
        return TeacherSamples(self.teacher, self.start, self.pad, options, self.states)

    def __iter__(self):
        recent = collections.deque(maxlen=self.options.sample_reads)  # the groups still to be read again
        for group in self._groups():
            recent.appendleft(group)
            for reading, texts in enumerate(recent):  # the new group's first reading, then the earlier groups' next
                yield from self._read(*texts, reading)
            if len(recent) == recent.maxlen:  # the oldest group was read for the last time
                self.kept.pop(recent[-1][0], None)

    def first_readings(self):
        """Every text once, in the order the stream first reads them."""
        for group in self._groups():
            yield from self._read(*group, reading=0)

    def _groups(self):
        """(index, texts, states) of every group in turn, those the layers' fit reads kept as they are sampled."""
        fitted, ahead, at_once = self.options.fit_texts, {}, groups_at_once(self.teacher, self.together)
        for group in itertools.count():
            if group not in self.kept and group not in ahead:
                ahead = self._sample(range(group, group + at_once), self.together)
            ids, states = self.kept[group] if group in self.kept else ahead.pop(group)
            if group * self.together < fitted:
                self.kept[group] = ids, states
            yield group, ids, states

    def _read(self, group: int, ids: torch.Tensor, states: torch.Tensor | None, reading: int):
        """A group's texts: in order at their first reading, else in an order seeded by the group and the reading."""
        shuffle = torch.Generator().manual_seed(group * self.options.sample_reads + reading)
        order = torch.randperm(len(ids), generator=shuffle).tolist() if reading else range(len(ids))
        rows = ids.tolist()
        for index in order:
            yield _text(rows[index]) if states is None else _text(rows[index]) | {TEACHER_STATES: states[index]}

    def sample(self, group: int, texts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The group's texts (`texts`, else `together`, x length) and, with `states`, the teacher's states on them
        (texts x boundaries x length x hidden)."""
        return self._sample([group], self.together if texts is None else texts)[group]

    def _sample(self, groups: Sequence[int], texts: int) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """`groups` of `texts` texts each, sampled in one generation: each text from its row of its group's draws
        (`uniform_draws` seeded by the group's index), every second one of a group from the token drawn after `start`,
        without it. Sampling one token more than the texts hold runs the teacher on every token they do hold."""
        options, device = self.options, compute_device(self.teacher)
        sampling = dict(temperature=options.sample_temperature, pad=self.pad)
        draws = torch.cat([uniform_draws(group, texts, 1 + options.sample_length) for group in groups])
        after = torch.arange(len(draws)) % texts % 2 == 1
        starts, rows = torch.full((len(draws), 1), self.start, device=device), after.to(device)
        first = continue_texts(self.teacher, starts[rows], draws[after, :1], **sampling, states=False)
        starts[rows] = first.sequences[:, 1:]
        sampled = continue_texts(self.teacher, starts, draws[:, 1:], **sampling, states=self.states)
        ids = sampled.sequences[:, :-1].cpu().split(texts)
        states = self._states(sampled.hidden_states).split(texts) if self.states else [None] * len(ids)
        return dict(zip(groups, zip(ids, states)))

    @staticmethod
    def _states(steps) -> torch.Tensor:
        """The states of a generation's steps (per step, per boundary: texts x new tokens x hidden) as one tensor:
        texts x boundaries x tokens x hidden."""
        first, positions = steps[0][0], sum(step[0].shape[1] for step in steps)
        states = first.new_empty(len(first), len(steps[0]), positions, first.shape[-1])
        for boundary, by_step in enumerate(zip(*steps)):
            torch.cat(by_step, 1, out=states[:, boundary])  # one copy, into place
        return states.cpu()


class SampledTexts(torch.utils.data.IterableDataset):
    """A stream's texts sampled ahead (`sampled_ahead`): `rows` (texts x length), those training reads, in the
    stream's order, and `fitted`, the first readings that the layers' fit reads."""

    def __init__(self, rows: torch.Tensor, fitted: torch.Tensor):
        self.rows, self.fitted = rows, fitted

    def __iter__(self):
        return (_text(row.tolist()) for row in self.rows)

    def first_readings(self):
        return (_text(row.tolist()) for row in self.fitted)


def _text(ids: list[int]) -> dict:
    return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def sampled_by_main_process(sample: Callable[[], torch.Tensor], shape: tuple, options: HealOptions) -> torch.Tensor:
    """`sample()` (token ids of `shape`), when sharded run by the main process alone, which holds the teacher's
    weights before it is sharded, and handed to every process."""
    ids = sample() if loads_weights(options.sharding) else None
    return from_main_process(ids, shape=shape) if sharded(options.sharding) else ids


def sampled_ahead(stream: TeacherSamples, texts: int, options: HealOptions) -> SampledTexts:
    """The first `texts` texts of `stream` in the order it reads them, and the first readings the layers' fit reads,
    sampled now (`sampled_by_main_process`, on the main process's CPU): a sharded healing trains on them as one
    process trains on its stream, the same texts on any device but where its rounding moves a draw across a token's
    edge."""
    fitted = options.fit_texts

    def sample() -> torch.Tensor:
        read = itertools.chain(itertools.islice(stream.first_readings(), fitted), itertools.islice(stream, texts))
        return torch.tensor([row["input_ids"] for row in read])

    rows = sampled_by_main_process(sample, (fitted + texts, options.sample_length), options)
    return SampledTexts(rows[fitted:], rows[:fitted])


def development_batches(teacher: torch.nn.Module, tokenizer, options: HealOptions) -> list[dict]:
    """`dev_size` texts sampled from the teacher as the training texts are, from a group of their own
    (`DEVELOPMENT_GROUP`), in batches of `DEVELOPMENT_BATCH` (`sampled_by_main_process`)."""

    def sample() -> torch.Tensor:
        start = start_token(tokenizer, teacher.config)
        stream = TeacherSamples(teacher, start=start, pad=tokenizer.pad_token_id, options=options, states=False)
        return stream.sample(DEVELOPMENT_GROUP, options.dev_size)[0]

    ids = sampled_by_main_process(sample, (options.dev_size, options.sample_length), options)
    return [{"input_ids": part, "attention_mask": torch.ones_like(part)} for part in ids.split(DEVELOPMENT_BATCH)]


@dataclass
class WithTeacherStates:
    """Batches texts as `pad` does, with the teacher's states if they came with them (`TEACHER_STATES`) stacked:
    texts x boundaries x length x hidden (the sampled texts are all of one length)."""

    pad: DataCollatorWithPadding

    def __call__(self, rows: list[dict]) -> dict:
        batch = dict(self.pad([{key: row[key] for key in row if key != TEACHER_STATES} for row in rows]))
        if TEACHER_STATES in rows[0]:
            batch[TEACHER_STATES] = torch.stack([row[TEACHER_STATES] for row in rows])
        return batch


def teacher_samples(teacher: torch.nn.Module, tokenizer, options: HealOptions) -> Dataset | TeacherSamples:
    """Texts sampled from the teacher after BOS (else EOS), every second one without it: `sample_count` of them
    sampled once (when sharded, by the main process, which alone holds the teacher's weights, for every process), or
    else an endless stream (`TeacherSamples`). On a CPU, in one process, the stream's texts come with the teacher's
    states on them: there the teacher's forward took a seventh of a healing step; on an accelerator it is cheap, and
    the states of the 1,024 texts it samples at once would take gigabytes of its memory. A sharded healing samples
    the stream's texts ahead (`sampled_ahead`), without the states, which the sharded teacher computes again."""
    start = start_token(tokenizer, teacher.config)
    if start is None:
        raise HealError("--data teacher needs a BOS or EOS token (the tokenizer's or the teacher's) to start from")
    states = options.sample_count is None and compute_device(teacher).type == "cpu" and not sharded(options.sharding)
    stream = TeacherSamples(teacher, start=start, pad=tokenizer.pad_token_id, options=options, states=states)
    if options.sample_count is None:
        return stream
    ids = sampled_by_main_process(
        lambda: torch.tensor([row["input_ids"] for row in itertools.islice(stream, options.sample_count)]),
        (options.sample_count, options.sample_length),
        options,
    )
    return Dataset.from_list([_text(row) for row in ids.tolist()])
