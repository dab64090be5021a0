"""Text ↔ tokens outside the scheduler: incremental detokenization and the detokenizer process."""

from moeserve.tokenizer.detokenizer import IncrementalDetokenizer, to_text_output

__all__ = ["IncrementalDetokenizer", "to_text_output"]
