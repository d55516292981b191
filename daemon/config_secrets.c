/*
 * Config, secrets: wiping libyaml's copy of each password.  Which source
 * a password comes from is the loader's call (secrets_resolve in
 * config.c), since its errors need the file's marks; reading a password
 * file is secret.c's.
 */
#include "config_internal.h"

#include <string.h>

/* libyaml keeps every scalar in the document.  A password may sit under
 * any key (postgres.password, a flat "postgres.password:", inside
 * postgres.conninfo), so every scalar is wiped before the memory goes
 * back to malloc: the document is deleted next anyway. */
void
cfg_document_wipe(yaml_document_t *doc)
{
	for (yaml_node_t *n = doc->nodes.start; n < doc->nodes.top; n++)
		if (n->type == YAML_SCALAR_NODE)
			explicit_bzero(n->data.scalar.value,
			    n->data.scalar.length);
}

/* The parser's input buffers hold the file's text, passwords included,
 * and yaml_parser_delete frees them as they are. */
void
cfg_parser_wipe(yaml_parser_t *parser)
{
	if (parser->raw_buffer.start != NULL)
		explicit_bzero(parser->raw_buffer.start,
		    (size_t)(parser->raw_buffer.end -
		    parser->raw_buffer.start));
	if (parser->buffer.start != NULL)
		explicit_bzero(parser->buffer.start,
		    (size_t)(parser->buffer.end - parser->buffer.start));
}
