"""`EngineChat`: a conversation rendered by the chat template (the tokenizer's or --chat-template)
into a prompt LLMEngine takes, its BOS written by the template, not added again."""
from kiln.engine.chat_template import render_chat_template
from kiln.engine.text_encoding import check_encodable, encode_text


class EngineChat:
    """Mixed into `LLMEngine` (llm_engine.py), whose `tokenizer` and `model_config` these read."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """Render a conversation with the tokenizer's chat template (HF's sandboxed Jinja);
        --chat-template, if given, stands for the tokenizer's."""
        if chat_template is None:
            chat_template = self.model_config.chat_template
        return render_chat_template(self.tokenizer, messages, add_generation_prompt,
                                    chat_template, self.model_config.model, **kwargs)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **kwargs) -> dict:
        """A rendered conversation as a prompt; the template already wrote BOS, so no extra one."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template, **kwargs)
        if not text:  # not the messages' fault: "prompt is empty" sent users looking there
            raise ValueError("the chat template rendered an empty prompt for these messages; "
                             "check the template (chat_template=, --chat-template)")
        check_encodable(text, "messages")  # a name or a template variable may hold one too
        return {"prompt": text,
                "prompt_token_ids": encode_text(self.tokenizer, text, add_special_tokens=False)}
