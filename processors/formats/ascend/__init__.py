"""The Ascend export (msModelSlim v1 and MindIE file names): ``quant_model_description*.json`` with
``quant_model_weight(s)*.safetensors``."""
