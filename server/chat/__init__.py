"""Model-free building blocks of OpenAI chat fidelity.

Owns: chat-template rendering with transformers' `apply_chat_template` semantics
(`template`), tool-call parsing for the common template families, whole-text and streamed
(`tool_calls`), and grammar-constrained decoding for `response_format` and forced tool calls
(`grammar`).

Invariant: nothing here loads a model, touches the engine or speaks HTTP. Each module takes
plain inputs (template text, OpenAI message dicts, generated text pieces, a `tokenizers`
tokenizer) and returns frozen dataclasses or plain dicts, so the engine and the HTTP layer can
call them without knowing how they work.
"""
