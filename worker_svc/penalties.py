"""Repetition, frequency and presence penalties (vLLM's semantics). A sequence's tokens are
counted over the vocabulary on the device, and the counts are kept from step to step
(`PenaltyCounts`, as SGLang's penalizers keep theirs): a step counts only the tokens a history
gained since the step before, with one `index_put_`, instead of sending every history to the
device again. No per-token loop in Python, no sync with the device."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
from pagedserve.worker_svc.host_to_device import to_device, to_device_many


class PenalizedState(Protocol):
    seq_id: int
    token_ids: list[int]  # prompt + outputs so far
    prompt_len: int


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
    token_ids: list[list[int]],  # per row: prompt + outputs so far
    prompt_lens: list[int],
    repetition_penalties: list[float],
    frequency_penalties: list[float],
    presence_penalties: list[float],
) -> torch.Tensor:
    """Repetition counts prompt and output tokens; frequency and presence count the output only.
    Every history counted from scratch."""
    seen, output_counts = _counts(token_ids, prompt_lens, logits.shape[1], logits.device)
    return _penalize(logits, seen, output_counts, repetition_penalties, frequency_penalties,
                     presence_penalties)


def _counts(token_ids: list[list[int]], prompt_lens: list[int], vocab_size: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_rows, vocab_size] bool: the token occurs in the row's history, [num_rows,
    vocab_size] float32: its count in the row's output), from the flattened ids."""
    num_rows = len(token_ids)
    seq_lens = [len(ids) for ids in token_ids]
    flat_ids = to_device(list(itertools.chain.from_iterable(token_ids)), torch.long,
                         device)  # [num_tokens]
    seq_lens_t = to_device(seq_lens, torch.long, device)  # [num_rows]
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), seq_lens_t,
                                     output_size=flat_ids.numel())  # [num_tokens]
    starts = torch.cumsum(seq_lens_t, dim=0) - seq_lens_t  # [num_rows]
    positions = torch.arange(flat_ids.numel(), device=device) - starts[row_of]  # [num_tokens]
    prompt_lens_t = to_device(prompt_lens, torch.long, device)
    is_output = (positions >= prompt_lens_t[row_of]).to(torch.float32)  # [num_tokens]
    flat_keys = row_of * vocab_size + flat_ids  # [num_tokens]

    seen_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    seen_counts.scatter_add_(0, flat_keys, torch.ones_like(is_output))
    output_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    output_counts.scatter_add_(0, flat_keys, is_output)
    return (seen_counts.view(num_rows, vocab_size) > 0,
            output_counts.view(num_rows, vocab_size))


def _penalize(logits: torch.Tensor, seen: torch.Tensor, output_counts: torch.Tensor,
              repetition_penalties: list[float], frequency_penalties: list[float],
              presence_penalties: list[float]) -> torch.Tensor:
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:  # [num_rows, 1]
        return to_device(values, torch.float32, device).unsqueeze(1)

    if any(p != 1.0 for p in repetition_penalties):
        repetition = column(repetition_penalties)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalised, logits))
    if any(p != 0.0 for p in frequency_penalties):
        logits.sub_(column(frequency_penalties) * output_counts)
    if any(p != 0.0 for p in presence_penalties):
        logits.sub_(column(presence_penalties) * (output_counts > 0).to(torch.float32))
    return logits


@dataclass(slots=True)
class _Slot:
    row: int
    token_ids: list[int]  # the history this row follows: appended to in place, never changed
    num_counted: int
    last_used: int  # the step that last read the row


class PenaltyCounts:
    """Per sequence, a row of counts that follows one history list (the worker mirror's, which
    only grows): a step counts the tokens it gained. A state whose sequence's row follows
    another list (a verified draft's row ends its history in drafts: a list of its own) is
    counted from scratch; the first state of a sequence in a step that brings a new list (the
    sequence sent whole again) takes the row over, counted anew. Rows are reused least recently
    used first, and the arrays grow when one step needs more rows than they have."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._output = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self._prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._slots: dict[int, _Slot] = {}
        self._free: list[int] = []  # rows no sequence holds, popped from the end
        self._step = 0

    @property
    def num_rows(self) -> int:
        return self._output.shape[0]

    def apply(self, logits: torch.Tensor, states: list[PenalizedState],
              repetition_penalties: list[float], frequency_penalties: list[float],
              presence_penalties: list[float]) -> torch.Tensor:
        """apply_penalties' result for these states' histories; logits [len(states), vocab]."""
        rows = self.follow(states)
        if len(rows) == len(states):
            seen, output_counts = self._read(rows)
        else:  # a draft's rows among them: this step's histories from scratch, as before
            seen, output_counts = _counts([s.token_ids for s in states],
                                          [s.prompt_len for s in states], self.vocab_size,
                                          self.device)
        return _penalize(logits, seen, output_counts, repetition_penalties, frequency_penalties,
                         presence_penalties)

    def _read(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        at = to_device(rows, torch.long, self.device)
        output_counts = self._output[at]
        return self._prompt[at] | (output_counts > 0), output_counts

    def follow(self, states: list[PenalizedState]) -> list[int]:
        """The rows of the states that follow their history, in order, each brought up to its
        history's length (all of them: the states are followed, row i ↔ states[i])."""
        self._step += 1
        in_step = {state.seq_id for state in states}
        rows, fresh, followed = [], [], []
        for state in states:
            slot = self._slots.get(state.seq_id)
            if slot is None or slot.token_ids is not state.token_ids:
                if slot is not None and slot.last_used == self._step:
                    continue  # a draft's row after its sequence's own: not followed
                slot = self._take(state, in_step)
                fresh.append(slot.row)
            slot.last_used = self._step
            rows.append(slot.row)
            followed.append((slot, state.prompt_len))
        self._count(followed, fresh)
        return rows

    def _take(self, state: PenalizedState, in_step: set[int]) -> _Slot:
        """A row for `state`'s history, counted from nothing: its sequence's row, else a free
        one, else that of the least recently used sequence no state of this step is of."""
        slot = self._slots.get(state.seq_id)
        if slot is None:
            if not self._free:
                idle = [seq_id for seq_id in self._slots if seq_id not in in_step]
                if idle:
                    oldest = min(idle, key=lambda seq_id: self._slots[seq_id].last_used)
                    self._free.append(self._slots.pop(oldest).row)
                else:
                    self._grow()
            slot = self._slots[state.seq_id] = _Slot(self._free.pop(), state.token_ids, 0,
                                                     self._step)
        slot.token_ids, slot.num_counted = state.token_ids, 0
        return slot

    def _grow(self) -> None:
        """Twice the rows (at least 8), the new ones free."""
        old = self.num_rows
        new = max(8, 2 * old)
        self._output = torch.cat([self._output, self._output.new_zeros(new - old, self.vocab_size)])
        self._prompt = torch.cat([self._prompt, self._prompt.new_zeros(new - old, self.vocab_size)])
        self._free.extend(range(new - 1, old - 1, -1))

    def _count(self, slots: list[tuple[_Slot, int]], fresh: list[int]) -> None:
        """Zeroes the fresh rows, then adds each slot's tokens past num_counted: those before
        its prompt_len as seen, the rest to the output counts."""
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        output_rows: list[int] = []
        output_ids: list[int] = []
        for slot, prompt_len in slots:
            start, end = slot.num_counted, len(slot.token_ids)
            if start == end:
                continue
            split = min(max(prompt_len, start), end)
            prompt_rows += [slot.row] * (split - start)
            prompt_ids += slot.token_ids[start:split]
            output_rows += [slot.row] * (end - split)
            output_ids += slot.token_ids[split:end]
            slot.num_counted = end
        if fresh:
            at = to_device(fresh, torch.long, self.device)
            self._output[at] = 0
            self._prompt[at] = False
        if not prompt_ids and not output_ids:
            return
        prompt_rows_t, prompt_ids_t, output_rows_t, output_ids_t = to_device_many(
            [(prompt_rows, torch.long), (prompt_ids, torch.long), (output_rows, torch.long),
             (output_ids, torch.long)], self.device)
        self._prompt[prompt_rows_t, prompt_ids_t] = True
        self._output.index_put_((output_rows_t, output_ids_t),
                                torch.ones(len(output_ids), device=self.device), accumulate=True)
