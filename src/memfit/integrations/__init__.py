"""memfit where people already train: one module per framework, each an optional extra.

    memfit.integrations.hf          Hugging Face Trainer (and trl's SFTTrainer): fit_trainer, MemfitCallback
    memfit.integrations.accelerate  accelerate: prepare, find_batch_size (keeps the effective batch)
    memfit.integrations.lightning   Lightning 2.6: MemfitPrecision, MemfitCallback
    memfit.integrations.peft        peft LoRA: prepare_model_for_kbit_training's checkpointing replaced by the plan
    memfit.integrations.torchtitan  a torchtitan job TOML estimated (memfit estimate --torchtitan)
    memfit.integrations.deepspeed   a DeepSpeed config estimated per rank (memfit estimate --deepspeed)
    memfit.integrations.emit_*      a plan as torchtitan's, accelerate's, Lightning's or DeepSpeed's config
                                    (memfit plan --emit; emit_plan reads the plan, one writer per framework)

The framework is imported by its own module only (`import memfit` never imports it). docs/integrations.md
has a runnable example per framework.
"""
