// The framed stream of `demesne-init pty`: see frame.h. Pure, so it is fuzzed
// (tests/fuzz/pty_frame.c) and shared by demesne-init and the host.
#include "frame.h"

static unsigned be16(const uint8_t *p)
{
	return ((unsigned)p[0] << 8) | p[1];
}

int frame_parse(const uint8_t *buf, size_t len, struct frame *f)
{
	if (len < FRAME_HEAD)
		return 0;
	uint8_t type = buf[0];
	size_t n = be16(buf + 1);
	switch (type) {
	case FRAME_DATA:
		if (n < 1 || n > FRAME_MAX)
			return -1;
		break;
	case FRAME_WINSIZE:
		if (n != 4)
			return -1;
		break;
	case FRAME_EXIT:
		if (n != 1)
			return -1;
		break;
	default: return -1;
	}
	if (len - FRAME_HEAD < n)
		return 0;
	f->type = type;
	f->len = n;
	f->data = buf + FRAME_HEAD;
	f->rows = f->cols = 0;
	f->status = 0;
	if (type == FRAME_WINSIZE) {
		f->rows = be16(f->data);
		f->cols = be16(f->data + 2);
		if (f->rows < 1 || f->cols < 1 || f->rows > FRAME_WINSIZE_MAX || f->cols > FRAME_WINSIZE_MAX)
			return -1;
	} else if (type == FRAME_EXIT) {
		f->status = f->data[0];
	}
	return (int)(FRAME_HEAD + n);
}

void frame_head(uint8_t *out, uint8_t type, size_t len)
{
	out[0] = type;
	out[1] = (uint8_t)(len >> 8);
	out[2] = (uint8_t)len;
}

void frame_winsize(uint8_t *out, unsigned rows, unsigned cols)
{
	frame_head(out, FRAME_WINSIZE, 4);
	out[3] = (uint8_t)(rows >> 8);
	out[4] = (uint8_t)rows;
	out[5] = (uint8_t)(cols >> 8);
	out[6] = (uint8_t)cols;
}
