"""Chat templates of the tool-calling model families, cut to what a tiny test model needs: each
renders the tools, earlier tool calls and tool results as its family does, with the markers by
which the server picks its tool-call syntax (pflash_plugin/chat/tool_calls.py)."""

# Hermes 2 Pro / Qwen 2.5: tools listed in <tools>, calls in <tool_call> tags, results from "tool"
HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Llama 3.1 / 3.2: tools in the user turn, a call as {"name", "parameters"}, results from "ipython"
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ 'ipython' if message['role'] == 'tool' else message['role'] }}<|end_header_id|>\n\n"
    "{% if tools and loop.last and message['role'] == 'user' %}"
    "Given the following functions, respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\n\n"
    "{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}{% endif %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<|python_tag|>{\"name\": \"{{ call['function']['name'] }}\", \"parameters\": "
    "{{ call['function']['arguments'] }}}"
    "{% endfor %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Mistral v3: tools in [AVAILABLE_TOOLS], calls as [TOOL_CALLS][{...}], results in [TOOL_RESULTS]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{{ message['content'] }}[/TOOL_RESULTS]"
    "{% elif message.get('tool_calls') %}[TOOL_CALLS]["
    "{% for call in message['tool_calls'] %}{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] }}, \"id\": \"{{ call['id'] }}\"}{{ ', ' if not loop.last }}{% endfor %}]"
    "{{ eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

TOOL_TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
