"""Writes the amqp_frames fuzz seeds (fuzz/seeds/amqp_frames/) as frames on the wire, each named
`<outcome>-<what it is>` (tests/fuzz_seeds.rs checks the outcome: what became of the copy of each
content header, `fits`, `cut` or `refused`, joined by `+`, or `none`).

    python3 fuzz/make_amqp_frames_seeds.py fuzz/seeds/amqp_frames
"""
import struct, os, sys
sys.setrecursionlimit(20000)
out = sys.argv[1]

def ss(b):
    if isinstance(b, str): b = b.encode()
    assert len(b) < 256
    return bytes([len(b)]) + b
def ls(b):
    if isinstance(b, str): b = b.encode()
    return struct.pack('>I', len(b)) + b
def val(v):
    # v: (type, payload)
    t, p = v
    if t == 'S': return b'S' + ls(p)
    if t == 'I': return b'I' + struct.pack('>i', p)
    if t == 'l': return b'l' + struct.pack('>q', p)
    if t == 't': return b't' + bytes([1 if p else 0])
    if t == 'T': return b'T' + struct.pack('>Q', p)
    if t == 'V': return b'V'
    if t == 'x': return b'x' + ls(p)
    if t == 'F': return b'F' + table(p)
    if t == 'A':
        body = b''.join(val(x) for x in p)
        return b'A' + struct.pack('>I', len(body)) + body
    raise ValueError(t)
def table(entries):
    body = b''.join(ss(k) + val(v) for k, v in entries)
    return struct.pack('>I', len(body)) + body

ORDER = ['content_type','content_encoding','headers','delivery_mode','priority','correlation_id',
         'reply_to','expiration','message_id','timestamp','type','user_id','app_id','cluster_id']
def header_frame(props, channel=1, body_size=0, end=0xCE):
    flags = 0
    payload = b''
    for i, name in enumerate(ORDER):
        if name in props:
            flags |= 1 << (15 - i)
            v = props[name]
            if name == 'headers': payload += table(v)
            elif name in ('delivery_mode', 'priority'): payload += bytes([v])
            elif name == 'timestamp': payload += struct.pack('>Q', v)
            else: payload += ss(v)
    p = struct.pack('>HHQH', 60, 0, body_size, flags) + payload
    return struct.pack('>BHI', 2, channel, len(p)) + p + bytes([end])
def method_publish(exchange='', key='q', channel=1):
    p = struct.pack('>HHH', 60, 40, 0) + ss(exchange) + ss(key) + bytes([0])
    return struct.pack('>BHI', 1, channel, len(p)) + p + b'\xce'
def body_frame(data, channel=1):
    return struct.pack('>BHI', 3, channel, len(data)) + data + b'\xce'
HEARTBEAT = struct.pack('>BHI', 8, 0, 0) + b'\xce'

LIMIT = 131072 - 4096  # header_limit(131072)

def padded(target_frame_len, extra=()):
    """A header frame whose whole frame is target_frame_len bytes: headers with x-blob padding."""
    base = header_frame({'headers': list(extra) + [('x-blob', ('S', b''))], 'message_id': 'm-1'})
    pad = target_frame_len - len(base)
    f = header_frame({'headers': list(extra) + [('x-blob', ('S', b'p' * pad))], 'message_id': 'm-1'})
    assert len(f) == target_frame_len
    return f

seeds = {}
every = {
    'content_type': 'application/json', 'content_encoding': 'gzip',
    'headers': [
        ('CC', ('A', [('S', 'other-queue')])), ('BCC', ('A', [('S', 'hidden')])),
        ('x-delivery-count', ('l', 7)), ('x-retries', ('I', 2)),
        ('x-retry-reason', ('S', 'db_error: timeout')),
        ('x-death', ('A', [('F', [('queue', ('S', 'main')), ('reason', ('S', 'expired')),
                                    ('count', ('l', 3)), ('exchange', ('S', 'retry')),
                                    ('routing-keys', ('A', [('S', 'main')])),
                                    ('time', ('T', 1700000000))])])),
        ('traceparent', ('S', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')),
        ('tenant', ('F', [('id', ('l', 42)), ('ok', ('t', True)), ('none', ('V', None))])),
        ('raw', ('x', b'\x00\x01\xff')),
    ],
    'delivery_mode': 1, 'priority': 9, 'correlation_id': 'c-1', 'reply_to': 'amq.rabbitmq.reply-to',
    'expiration': '60000', 'message_id': 'm-every', 'timestamp': 1700000000, 'type': 'user.created',
    'user_id': 'someone-else', 'app_id': 'publisher', 'cluster_id': 'c',
}
seeds['fits-every_property'] = header_frame(every)
# Invalid UTF-8 in short strings: a Latin-1 message id, a header key, a content type.
seeds['fits-invalid_utf8_short_strings'] = header_frame({
    'message_id': b'caf\xe9-\xff\xfe', 'content_type': b'\xc3(', 'reply_to': b'\x80' * 255,
    'headers': [(b'k\xe9y', ('S', b'v\xff')), (b'\xff' * 255, ('I', 1))]})
# Tables nested far deeper than the parser's 64 levels.
nested = ('F', [])
for _ in range(300):
    nested = ('F', [('n', nested)])
seeds['fits-nested_300_levels'] = header_frame({'headers': [('deep', nested)]})
arr = ('A', [])
for _ in range(300):
    arr = ('A', [arr])
seeds['fits-arrays_nested_300_levels'] = header_frame({'headers': [('deep', arr)]})
# Many tiny entries and an array of voids (parse to many times their wire size).
seeds['fits-array_of_20000_voids'] = header_frame({'headers': [('voids', ('A', [('V', None)] * 20000))]})
seeds['fits-400_tiny_entries'] = header_frame({'headers': [('k%d' % i, ('t', True)) for i in range(400)]})
# The copy (the original plus x-retries and a 2000-byte reason) over the limit by about 1000 bytes:
# cutting warren's reason makes it fit.
seeds['cut-reason_near_the_limit'] = padded(LIMIT - 1000)
# The publisher's own x-retry-reason is large: cutting warren's reason is not enough, cutting
# theirs too is.
seeds['cut-publishers_own_long_retry_reason'] = padded(LIMIT + 20000,
    extra=[('x-retry-reason', ('S', 'r' * 60000))])
# Over the limit on its own: refused however the reasons are cut.
seeds['refused-header_over_the_limit'] = padded(LIMIT + 3000)
seeds['refused-header_of_a_full_frame'] = padded(131072)
# A whole publish as on the wire: method, header, body, heartbeat, then another message.
seeds['fits+fits-two_publishes_and_a_heartbeat'] = (
    method_publish() + header_frame({'message_id': 'a', 'delivery_mode': 2}, body_size=2)
    + body_frame(b'{}') + HEARTBEAT + method_publish()
    + header_frame(every, body_size=0))
seeds['fits+refused-a_small_header_then_one_over_the_limit'] = (
    header_frame({'message_id': 'a'}) + padded(LIMIT + 3000))
# Nothing parses as a content header.
seeds['none-method_body_and_heartbeat_only'] = method_publish() + body_frame(b'x') + HEARTBEAT
good = header_frame({'message_id': 'm-1', 'headers': [('a', ('S', 'b'))]})
seeds['none-truncated_header_frame'] = good[:-5]
seeds['none-wrong_frame_end'] = good[:-1] + b'\x00'
seeds['none-header_size_past_the_data'] = good[:3] + struct.pack('>I', 1 << 30) + good[7:]
seeds['none-empty'] = b''
# A table whose declared length runs past the frame.
bad = bytearray(header_frame({'headers': [('a', ('S', 'b'))]}))
# headers table length sits right after the flags: 7 (frame head) + 14 (class, weight, size, flags)
bad[21:25] = struct.pack('>I', 10_000)
seeds['none-table_length_past_the_frame'] = bytes(bad)
for name, data in seeds.items():
    open(os.path.join(out, name), 'wb').write(data)
    print(name, len(data))
