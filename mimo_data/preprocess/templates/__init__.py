"""Chat templates mimo ships: a published template with ``{% generation %}`` blocks added around
what each assistant turn writes, where the published one cannot place the loss of every turn
(the text rendered is the published template's, character for character)."""
