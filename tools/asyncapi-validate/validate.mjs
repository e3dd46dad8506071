// Validates AsyncAPI documents with the AsyncAPI project's own parser (@asyncapi/parser), the reference for what a
// tool such as the AsyncAPI generator or Studio will accept. Prints one line per diagnostic at warning level or
// worse (`--verbose`: all) and exits 1 when any has error severity, 0 otherwise.
//
//   node tools/asyncapi-validate/validate.mjs [--verbose] [document ...]   (default: docs/asyncapi/asyncapi.json)
import { fileURLToPath } from 'node:url';
import path from 'node:path';
import { Parser, fromFile, DiagnosticSeverity } from '@asyncapi/parser';

const here = path.dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const verbose = args.includes('--verbose');
const documents = args.filter((arg) => arg !== '--verbose');
if (documents.length === 0) documents.push(path.join(here, '..', '..', 'docs', 'asyncapi', 'asyncapi.json'));

const names = { [DiagnosticSeverity.Error]: 'error', [DiagnosticSeverity.Warning]: 'warning',
                [DiagnosticSeverity.Information]: 'info', [DiagnosticSeverity.Hint]: 'hint' };
const parser = new Parser();
let failed = false;
for (const document of documents) {
  const shown = path.relative(process.cwd(), document) || document;
  const { document: parsed, diagnostics } = await fromFile(parser, document).parse();
  const errors = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Error).length;
  const warnings = diagnostics.filter((d) => d.severity === DiagnosticSeverity.Warning).length;
  for (const d of diagnostics) {
    if (!verbose && d.severity > DiagnosticSeverity.Warning) continue;
    const where = d.path && d.path.length ? `#/${d.path.join('/')}` : '#';
    console.log(`${shown}: ${names[d.severity] ?? d.severity} ${d.code} at ${where}: ${d.message}`);
  }
  if (parsed === undefined || errors > 0) {
    failed = true;
    console.log(`${shown}: INVALID (${errors} errors, ${warnings} warnings)`);
  } else {
    console.log(`${shown}: valid AsyncAPI ${parsed.version()} (${warnings} warnings)`);
  }
}
process.exit(failed ? 1 : 0);
