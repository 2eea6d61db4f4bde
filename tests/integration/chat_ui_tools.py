"""A chat front end's built-in tool list, as such a client attaches it to every chat request.

Sized and shaped like Open WebUI 0.12's default (issue 48: 36 tools, about 26 KB of JSON,
no `tool_choice`): tools for web search, memories, notes, past chats, channels, knowledge
bases, files, images and code, each with a paragraph of description and described
parameters (strings, integers, arrays, optional timestamps). The names and texts are this
project's own writing; only the size and the kinds of tool follow the client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chat_ui_tools"]

_S, _I, _A = "string", "integer", "array"

_COUNT = ("count", _I, "How many results to return at most. Defaults to 5; use a larger "
          "value only when the user asks for a broad overview, and a smaller one when a single "
          "best match is enough. Results come sorted by relevance, best first.", False)
_START = ("start_timestamp", _I, "Only include items updated at or after this Unix time in "
          "seconds. Leave it out to search from the beginning. Use calculate_timestamp to turn "
          "phrases such as 'last week' into a timestamp first.", False)
_END = ("end_timestamp", _I, "Only include items updated before this Unix time in seconds. "
        "Leave it out to search up to now. Use calculate_timestamp to turn phrases such as "
        "'before March' into a timestamp first.", False)
_QUERY = ("query", _S, "The words to search for, as the user would type them into a search "
          "box. Keep it short and specific; rewrite pronouns into the names they refer to, "
          "drop filler words, and keep names, numbers and quoted phrases exactly as the user "
          "wrote them. Search in the language of the material, not only the user's. Make "
          "one call per topic rather than one long query.", True)

# (name, description, [(parameter, type, description, required), ...])
_TOOLS: list[tuple[str, str, list[tuple[str, str, str, bool]]]] = [
    ("search_web", "Search the public web and return the best matching pages with their "
     "titles, addresses and a short snippet each. Use it for current events, facts that may "
     "have changed since training, prices, schedules and anything the user asks to look up. "
     "Do not use it for questions you can answer from the conversation. Cite the addresses of "
     "the pages you use, and prefer recent and primary sources over aggregators.",
     [_QUERY, _COUNT]),
    ("fetch_url", "Download one web page and return its readable text (navigation, scripts "
     "and advertisements removed). Use it after a search to read a result in full, or when "
     "the user pastes a link and asks about its content. Long pages are cut after about "
     "50,000 characters; say so when the answer may lie beyond that point.",
     [("url", _S, "The absolute http or https address of the page to read.", True)]),
    ("get_current_timestamp", "Return the current date and time as a Unix timestamp in "
     "seconds and as an ISO 8601 string in the user's time zone. Use it before answering "
     "questions about today, deadlines or how long ago something happened.", []),
    ("calculate_timestamp", "Compute the Unix timestamp of a moment relative to now, for "
     "example the start of last week or three months ago. Combine the offsets as needed; "
     "every offset left out counts as zero.",
     [("days_ago", _I, "Days to go back from now.", False),
      ("weeks_ago", _I, "Weeks to go back from now.", False),
      ("months_ago", _I, "Calendar months to go back from now.", False),
      ("years_ago", _I, "Calendar years to go back from now.", False)]),
    ("search_memories", "Search the facts the user asked the assistant to remember in "
     "earlier conversations (preferences, names, projects). Use it when the user refers to "
     "something personal that is not in the current conversation. Memories are short "
     "sentences; treat them as possibly outdated when they contradict the user.",
     [_QUERY, _COUNT]),
    ("add_memory", "Store a new fact about the user for later conversations. Only store what "
     "the user explicitly asked to remember or clearly wants kept, in one short sentence. "
     "Never store passwords, keys or other secrets, even when asked.",
     [("content", _S, "The fact to remember, written as a full sentence in the third person.",
       True)]),
    ("replace_memory_content", "Replace the text of one stored memory, for example when the "
     "user corrects a fact that was remembered earlier.",
     [("memory_id", _S, "The id of the memory, as returned by search_memories.", True),
      ("content", _S, "The corrected fact, written as a full sentence.", True)]),
    ("delete_memory", "Delete one stored memory the user no longer wants kept. Confirm with the user first "
     "when it is not clear which memory they mean.",
     [("memory_id", _S, "The id of the memory, as returned by search_memories.", True)]),
    ("list_memories", "List the most recent stored memories with their ids, newest first. Use it when the "
     "user asks what the assistant remembers about them.",
     [_COUNT]),
    ("search_notes", "Search the user's notes by title and content. Returns each match's id, "
     "title, a snippet and when it was last edited. Use view_note to read a match in full "
     "before quoting it.",
     [_QUERY, _COUNT, _START, _END]),
    ("view_note", "Return the full content of one note in Markdown, with its title, its tags and when it "
     "was created and last edited.",
     [("note_id", _S, "The id of the note, as returned by search_notes.", True)]),
    ("write_note", "Create a new note for the user. Use it when the user asks to save a "
     "summary, a list or a draft for later. Tell the user the title you chose so that they "
     "can find the note again.",
     [("title", _S, "A short title for the note.", True),
      ("content", _S, "The body of the note in Markdown.", True)]),
    ("replace_note_content", "Replace the content of an existing note, and optionally its "
     "title. The previous content is kept in the note's history.",
     [("note_id", _S, "The id of the note, as returned by search_notes.", True),
      ("content", _S, "The new body of the note in Markdown.", True),
      ("title", _S, "A new title; leave it out to keep the current one.", False)]),
    ("search_chats", "Search the user's earlier conversations by title and message text. "
     "Returns each match's id, title, a snippet and when it was last active. Use it when "
     "the user refers to something discussed before, e.g. 'what did we decide yesterday'.",
     [_QUERY, _COUNT, _START, _END]),
    ("view_chat", "Return the messages of one earlier conversation, oldest first, with the model that "
     "wrote each answer. Long conversations are cut to their last 100 messages.",
     [("chat_id", _S, "The id of the conversation, as returned by search_chats.", True)]),
    ("rename_chat", "Give one conversation a new title, for example when the user asks to file it under a "
     "clearer name. The conversation itself is not changed.",
     [("chat_id", _S, "The id of the conversation, as returned by search_chats.", True),
      ("title", _S, "The new title, at most a few words.", True)]),
    ("search_channels", "Search the shared channels the user belongs to by name and topic. Returns each "
     "channel's id, name, topic and member count.",
     [_QUERY, _COUNT]),
    ("search_channel_messages", "Search the messages posted in shared channels. Restrict the "
     "search to one channel when the user names it. Results include the channel's name, the "
     "author and the time of each message.",
     [_QUERY, ("channel_id", _S, "Only search this channel; leave it out to search all of "
               "the user's channels.", False), _COUNT, _START, _END]),
    ("view_channel_message", "Return one channel message with its author, time, "
     "reactions and attachments, and the number of replies in its thread.",
     [("message_id", _S, "The id of the message, as returned by search_channel_messages.",
       True)]),
    ("view_channel_thread", "Return every reply in the thread under one channel message, "
     "oldest first, with each reply's author and time.",
     [("parent_message_id", _S, "The id of the message that started the thread.", True)]),
    ("list_knowledge_bases", "List the knowledge bases (collections of documents) the user "
     "can read, with their ids, names and descriptions. Use the ids with "
     "query_knowledge_bases.",
     [_COUNT, ("skip", _I, "How many knowledge bases to skip, for paging.", False)]),
    ("search_knowledge_bases", "Search the knowledge bases by name and description, to find "
     "which collection holds the documents the user means before querying it. Returns each "
     "knowledge base's id, name, description and number of files.",
     [_QUERY, _COUNT]),
    ("query_knowledge_bases", "Retrieve the passages most relevant to a question from the "
     "documents of one or more knowledge bases. Use it to answer questions about the user's "
     "own documents; quote the passages you rely on and name the files they come from. When "
     "nothing relevant is found, say so instead of answering from general knowledge.",
     [_QUERY, ("knowledge_ids", _A, "The ids of the knowledge bases to search; leave it out "
               "to search all of them.", False), _COUNT]),
    ("search_knowledge_files", "Search the files of the knowledge bases by file name. Returns each file's id, name, "
     "size, type and the knowledge base it belongs to.",
     [_QUERY, ("knowledge_id", _S, "Only search the files of this knowledge base.", False),
      _COUNT]),
    ("query_knowledge_files", "Retrieve the passages most relevant to a question from "
     "specific files of the knowledge bases. Use it when the user names the documents to "
     "read; quote the passages you rely on.",
     [_QUERY, ("file_ids", _A, "The ids of the files to search, as returned by "
               "search_knowledge_files.", True), _COUNT]),
    ("view_knowledge_file", "Return the full extracted text of one knowledge base file. Very long files are cut "
     "after about 100,000 characters.",
     [("file_id", _S, "The id of the file, as returned by search_knowledge_files.", True)]),
    ("list_files", "List the files the user uploaded, newest first, with their ids, names, "
     "sizes and types, and the conversations they were shared in.",
     [_COUNT, ("skip", _I, "How many files to skip, for paging.", False)]),
    ("view_file", "Return the extracted text of one file the user uploaded. Images come back as a "
     "description, spreadsheets as comma-separated rows.",
     [("file_id", _S, "The id of the file, as returned by list_files.", True)]),
    ("generate_image", "Create an image from a text description with the configured image "
     "model and show it in the chat. Use it only when the user asks for a picture. Describe "
     "the picture in words as well, and do not generate images of real private persons.",
     [("prompt", _S, "A detailed description of the image: subject, style, colours, "
       "composition and mood.", True),
      ("size", _S, "The size in pixels as WIDTHxHEIGHT, e.g. 1024x1024.", False)]),
    ("edit_image", "Change an existing image according to an instruction, for example to "
     "remove an object or change the background. The result is shown in the chat next to the "
     "original.",
     [("prompt", _S, "What to change in the image, in one or two sentences.", True),
      ("image_urls", _A, "The addresses of the images to edit.", True)]),
    ("execute_code", "Run a Python program in a sandbox and return what it printed, its "
     "errors and any files it wrote. Use it for calculations, data analysis and charts; the "
     "sandbox has no network access. Print the values you need: only printed output and "
     "files written to the working directory come back. Each call starts a fresh process.",
     [("code", _S, "The complete Python program to run.", True)]),
    ("search_prompts", "Search the user's saved prompt templates by command and title. Use it when the user "
     "refers to a template they saved, e.g. 'my usual summary format'.",
     [_QUERY, _COUNT]),
    ("view_prompt", "Return the text of one saved prompt template with its placeholders, so that it can be "
     "filled in and followed.",
     [("command", _S, "The template's slash command, e.g. /summarize.", True)]),
    ("list_models", "List the models the user may chat with, with their ids and "
     "descriptions. Use it when the user asks which models are available or which one "
     "suits a task.", []),
    ("get_model_info", "Return one model's description, context length and capabilities (vision, tools, "
     "reasoning), and who may use it.",
     [("model_id", _S, "The id of the model, as returned by list_models.", True)]),
    ("send_notification", "Show a notification to the user outside the chat, for example "
     "when a long task has finished. Use it sparingly: only when the user asked to be told.",
     [("title", _S, "A short title.", True),
      ("body", _S, "The text of the notification, one or two sentences.", True)]),
]


def chat_ui_tools() -> list[dict[str, Any]]:
    """The tool list in OpenAI's `tools` form: 36 functions, about 26 KB as JSON."""
    out = []
    for name, description, params in _TOOLS:
        props: dict[str, Any] = {}
        for pname, ptype, pdesc, _ in params:
            props[pname] = {"type": ptype, "description": pdesc}
            if pname in ("count", "skip"):
                props[pname].update({"minimum": 0 if pname == "skip" else 1,
                                     "default": 0 if pname == "skip" else 5})
            if ptype == _A:
                props[pname]["items"] = {"type": "string"}
        out.append({"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": props,
                           "required": [p[0] for p in params if p[3]]}}})
    return out
