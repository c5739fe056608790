"""memfit where people already train: one module per framework, each an optional extra.

    memfit.integrations.hf          Hugging Face Trainer (and trl's SFTTrainer): fit_trainer, MemfitCallback
    memfit.integrations.accelerate  accelerate: prepare, find_batch_size (keeps the effective batch)
    memfit.integrations.lightning   Lightning 2.6: MemfitPrecision, MemfitCallback
    memfit.integrations.peft        peft LoRA: prepare_model_for_kbit_training's checkpointing replaced by the plan

The framework is imported by its own module only (`import memfit` never imports it). docs/integrations.md
has a runnable example per framework.
"""
