"""The NextN draft head's trainer (`python -m moeserve.spec_mtp.training`): self-distillation
data, the trainable head, the optimizer loop and the held-out agreement table. Serving never
imports it; it shares the draft vocabulary, prompts and tree statistics with spec_mtp/."""
