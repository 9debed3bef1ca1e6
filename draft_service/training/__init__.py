"""Training EAGLE-3 draft heads (`tandem train-draft`): target-generated data, training-time test, export.

Modules, one job each: data (where prompts come from), target (continuations,
features and logits from the target via transformers), vocab (the draft
vocabulary), module (the draft as a trainable torch module with SGLang's
tensor names), ttt (the unrolled loss), checkpoint (periodic state and
resume), export (SGLang's checkpoint format), main (the command line).
"""
