#include "textflag.h"

// func addF32(out, left, right *float32, n int)
// out[i] = left[i] + right[i] for i < n, n a multiple of 32 (AVX2).
TEXT ·addF32(SB), NOSPLIT, $0-32
	MOVQ out+0(FP), DI
	MOVQ left+8(FP), SI
	MOVQ right+16(FP), DX
	MOVQ n+24(FP), CX
	SHRQ $5, CX
	JZ   done32

loop32:
	VMOVUPS 0(SI), Y0
	VMOVUPS 32(SI), Y1
	VMOVUPS 64(SI), Y2
	VMOVUPS 96(SI), Y3
	VADDPS  0(DX), Y0, Y0
	VADDPS  32(DX), Y1, Y1
	VADDPS  64(DX), Y2, Y2
	VADDPS  96(DX), Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, SI
	ADDQ    $128, DX
	ADDQ    $128, DI
	DECQ    CX
	JNZ     loop32
	VZEROUPPER

done32:
	RET

// func addF64(out, left, right *float64, n int)
// out[i] = left[i] + right[i] for i < n, n a multiple of 16 (AVX2).
TEXT ·addF64(SB), NOSPLIT, $0-32
	MOVQ out+0(FP), DI
	MOVQ left+8(FP), SI
	MOVQ right+16(FP), DX
	MOVQ n+24(FP), CX
	SHRQ $4, CX
	JZ   done64

loop64:
	VMOVUPD 0(SI), Y0
	VMOVUPD 32(SI), Y1
	VMOVUPD 64(SI), Y2
	VMOVUPD 96(SI), Y3
	VADDPD  0(DX), Y0, Y0
	VADDPD  32(DX), Y1, Y1
	VADDPD  64(DX), Y2, Y2
	VADDPD  96(DX), Y3, Y3
	VMOVUPD Y0, 0(DI)
	VMOVUPD Y1, 32(DI)
	VMOVUPD Y2, 64(DI)
	VMOVUPD Y3, 96(DI)
	ADDQ    $128, SI
	ADDQ    $128, DX
	ADDQ    $128, DI
	DECQ    CX
	JNZ     loop64
	VZEROUPPER

done64:
	RET
