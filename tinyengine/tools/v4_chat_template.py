"""DeepSeek-V4's chat format as a Jinja chat template, for the V4 presets
(the tokenizer package ships V4's tokenizer.json but no template, and V4's
release encodes prompts with Python, `encoding_dsv4.py`, not a template).

Owns the template text. It follows the release's encoding for system, user
and assistant messages (tool calls and DeepSeek's task tokens are not
rendered):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>...

- Chat mode (the default): every assistant turn opens with
  `<｜Assistant｜></think>` (an empty thought), and so does the generation
  prompt.
- Thinking mode (`chat_template_kwargs={"thinking": True}`, the name vLLM's
  DeepSeek templates use): the generation prompt after the last user turn
  opens a thought, `<｜Assistant｜><think>`; earlier assistant turns keep the
  empty-thought opening and drop their reasoning, as the release does by
  default; an assistant turn after the last user message (a prefilled
  continuation) is written `{reasoning_content}</think>{content}`.
"""

from __future__ import annotations

V4_CHAT_TEMPLATE = (
    # Content is a string or a list of OpenAI content parts (their text joined).
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is defined and content is not none -%}"
    "{%- for part in content -%}"
    "{{- part['text'] if part['type'] == 'text' else '' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set thinking = thinking is defined and thinking -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{- text(m['content']) -}}"
    "{%- elif m['role'] == 'user' -%}<｜User｜>{{- text(m['content']) -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if thinking and loop.index0 > ns.last_user -%}"
    "{{- text(m['reasoning_content']) -}}</think>"
    "{%- endif -%}"
    "{{- text(m['content']) -}}<｜end▁of▁sentence｜>"
    "{%- endif -%}"
    "{%- if m['role'] == 'user' and ((loop.last and add_generation_prompt)"
    " or (not loop.last and loop.nextitem['role'] == 'assistant')) -%}"
    "<｜Assistant｜>{{- '<think>' if thinking and loop.index0 == ns.last_user else '</think>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
