"""Prompt loading, chat-template tokenization with assistant loss masks, and task-disjoint splits."""
